// What the page remembers over a reload, in the browser's own storage (never in a notebook):
// the cells run while a kernel waited (this tab: sessionStorage), and which ended leases
// were told or dismissed (this browser: localStorage). Keys carry the server's base URL: a
// hub serves every student's server from one origin.
import { PageConfig } from '@jupyterlab/coreutils';

const PREFIX = 'jupyter-gpu-lease';

function area(kind: 'session' | 'local'): Storage | null {
  try {
    return kind === 'session' ? window.sessionStorage : window.localStorage;
  } catch {
    return null; // storage refused (privacy settings): remember nothing
  }
}

function key(name: string): string {
  return `${PREFIX}:${PageConfig.getBaseUrl()}:${name}`;
}

/** A JSON value under `name`, or `fallback` when none (or unreadable). */
export function recall<T>(kind: 'session' | 'local', name: string, fallback: T): T {
  const text = area(kind)?.getItem(key(name));
  if (!text) {
    return fallback;
  }
  try {
    return JSON.parse(text) as T;
  } catch {
    return fallback;
  }
}

/** Keep `value` under `name` (null: forget it). */
export function remember(kind: 'session' | 'local', name: string, value: unknown): void {
  const storage = area(kind);
  try {
    if (value === null) {
      storage?.removeItem(key(name));
    } else {
      storage?.setItem(key(name), JSON.stringify(value));
    }
  } catch {
    // full or refused: the page works without it
  }
}

/** A set of ids kept in localStorage (the newest `limit`), e.g. the leases already told. */
export class RememberedIds {
  constructor(
    private _name: string,
    private _limit = 200
  ) {}

  has(id: string): boolean {
    return recall<string[]>('local', this._name, []).includes(id);
  }

  add(id: string): void {
    const ids = recall<string[]>('local', this._name, []).filter(x => x !== id);
    ids.push(id);
    remember('local', this._name, ids.slice(-this._limit));
  }
}
