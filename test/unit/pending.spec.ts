// The one private part of JupyterLab the extension uses (src/pending.ts): this fails, in
// `make test`, for a JupyterLab whose SessionContext no longer has `_pendingKernelName` as
// the extension relies on, or that is outside the versions package.json says it supports.
// (tests/test_lab_version.py checks the JupyterLab installed in Python the same way.)
import { readFileSync } from 'fs';
import { join } from 'path';

import type { ISessionContext } from '@jupyterlab/apputils';

import {
  clearStarting,
  hasPendingName,
  missingMessage,
  showStarting,
  SUPPORTED_JUPYTERLAB
} from '../../src/pending';

const root = join(__dirname, '..', '..');
const modules = join(root, 'node_modules', '@jupyterlab');
const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'));

/** The body of `get name() { ... }` in SessionContext's compiled source. */
function getter(source: string, name: string): string {
  const start = source.indexOf(`get ${name}() {`);
  expect(start).toBeGreaterThan(0);
  const end = source.indexOf('\n    }\n', start);
  return source.slice(start, end);
}

/** Whether version "a.b.c" satisfies a range like ">=4.2 <5". */
function satisfies(version: string, range: string): boolean {
  const parse = (v: string) => v.split('.').map(Number);
  const cmp = (a: number[], b: number[]) => {
    for (let i = 0; i < 3; i++) {
      if ((a[i] ?? 0) !== (b[i] ?? 0)) {
        return (a[i] ?? 0) - (b[i] ?? 0);
      }
    }
    return 0;
  };
  return range.split(/\s+/).every(part => {
    const [, op, v] = /^(>=|<)(.+)$/.exec(part)!;
    const c = cmp(parse(version), parse(v));
    return op === '>=' ? c >= 0 : c < 0;
  });
}

describe("JupyterLab's SessionContext, as the extension uses it", () => {
  const source = readFileSync(join(modules, 'apputils', 'lib', 'sessioncontext.js'), 'utf8');

  it('has _pendingKernelName, a string set empty on construction', () => {
    const constructor = source.slice(source.indexOf('constructor(options)'));
    expect(constructor.slice(0, constructor.indexOf('\n    }\n'))).toContain(
      "this._pendingKernelName = '';"
    );
  });

  it('shows a pending kernel name as the kernel, initializing', () => {
    expect(getter(source, 'kernelDisplayName')).toContain('kernelspecs[this._pendingKernelName]');
    expect(getter(source, 'kernelDisplayStatus')).toMatch(
      /if \(!kernel && this\._pendingKernelName\) \{\s*return 'initializing';/
    );
  });

  it('is of a JupyterLab the extension says it supports', () => {
    const lab = JSON.parse(readFileSync(join(modules, 'core-meta', 'package.json'), 'utf8'));
    expect(pkg.supportedJupyterLab).toBe(SUPPORTED_JUPYTERLAB);
    expect(satisfies(lab.version, SUPPORTED_JUPYTERLAB)).toBe(true);
    expect(satisfies('4.1.9', SUPPORTED_JUPYTERLAB)).toBe(false); // the check can fail
    expect(satisfies('5.0.0', SUPPORTED_JUPYTERLAB)).toBe(false);
  });
});

describe('showStarting', () => {
  it('sets the pending name where JupyterLab has it, and clears it', () => {
    const context = { _pendingKernelName: '' } as unknown as ISessionContext;
    expect(hasPendingName(context)).toBe(true);
    expect(showStarting(context, 'python3-gpu-1')).toBe(true);
    expect((context as unknown as { _pendingKernelName: string })._pendingKernelName).toBe(
      'python3-gpu-1'
    );
    clearStarting(context);
    expect((context as unknown as { _pendingKernelName: string })._pendingKernelName).toBe('');
  });

  it('says so on the console, once, where the private field is gone', () => {
    const error = jest.spyOn(console, 'error').mockImplementation(() => undefined);
    const context = {} as ISessionContext;
    expect(showStarting(context, 'python3-gpu-1')).toBe(false);
    expect(showStarting(context, 'python3-gpu-1')).toBe(false);
    expect(error).toHaveBeenCalledTimes(1);
    expect(error.mock.calls[0][0]).toBe(missingMessage());
    expect(missingMessage()).toContain('_pendingKernelName');
    expect(missingMessage()).toContain(SUPPORTED_JUPYTERLAB);
    expect(context).toEqual({}); // nothing set
    error.mockRestore();
  });
});
