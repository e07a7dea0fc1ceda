// The browser's view of this server's GPU kernels: one poll of the server extension.
import { NotebookPanel } from '@jupyterlab/notebook';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { fetchKernels, IKernelLease, isParked, stopWaiting } from './api';

/** How long a kernel may wait, not queued yet, before the status bar says it waits. */
export const QUIET_MS = 3000;

/**
 * The GPU kernel started for the notebook at `path` that a page opening it attaches to
 * instead of starting or holding another: one waiting for its GPU, else one holding its
 * lease (the GPU may come while the page loads: attaching only to a waiting kernel, the
 * page held the notebook while its kernel ran unseen). Null when none.
 */
export function kernelToAttach(
  kernels: ReadonlyArray<IKernelLease>,
  path: string
): IKernelLease | null {
  const mine = kernels.filter(k => k.path === path);
  return (
    mine.find(k => k.state === 'waiting') ??
    mine.find(k => k.state === 'active' || isParked(k.state)) ??
    null
  );
}

/** Polls `GET {base_url}gpu-lease/api/kernels`; `changed` fires after each answer. */
export class GPULeaseModel {
  /** Polls once `start` is called, every `interval` ms (set from the settings first). */
  constructor() {
    this._poll = new Poll({
      auto: false,
      factory: () => this.refresh(),
      frequency: { backoff: true, max: 60_000 },
      name: 'jupyter-gpu-lease:kernels',
      standby: 'when-hidden'
    });
  }

  start(): void {
    void this._poll.start();
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get kernels(): ReadonlyArray<IKernelLease> {
    return this._kernels;
  }

  set interval(ms: number) {
    this._poll.frequency = { ...this._poll.frequency, interval: ms };
  }

  /** Ask the server now (after a start, a stop, or a user action). */
  async refresh(): Promise<void> {
    if (this.update(await fetchKernels())) {
      // a kernel shown from QUIET_MS on even if the broker said nothing yet: ask again then
      setTimeout(() => this.refreshSoon(), QUIET_MS + 50);
    }
  }

  /**
   * Take the server's answer (at time `now`): true when a kernel started waiting, which
   * the status bar shows after QUIET_MS even if the broker did not queue it yet.
   */
  update(kernels: IKernelLease[], now: number = Date.now()): boolean {
    this._kernels = kernels;
    const waiting = new Set<string>();
    let newlyWaiting = false;
    for (const k of kernels) {
      if (k.state === 'waiting') {
        waiting.add(k.kernel_id);
        if (!this._firstSeen.has(k.kernel_id)) {
          this._firstSeen.set(k.kernel_id, now);
          newlyWaiting = true;
        }
      }
    }
    for (const id of this._firstSeen.keys()) {
      if (!waiting.has(id)) {
        this._firstSeen.delete(id);
      }
    }
    this._changed.emit();
    return newlyWaiting;
  }

  /**
   * Whether to show this kernel now. A waiting kernel is shown once the broker queued
   * it (its place is known), or after QUIET_MS: on a free GPU the lease comes first, and
   * "GPU queue: waiting" only flashed before it.
   */
  shown(k: IKernelLease | null, now: number = Date.now()): boolean {
    if (!k || k.state !== 'waiting' || k.position) {
      return !!k;
    }
    const since = this._firstSeen.get(k.kernel_id);
    return since !== undefined && now - since >= QUIET_MS;
  }

  /** The kernel that waits for its GPU for the notebook at `path`, if any. */
  waitingFor(path: string): IKernelLease | null {
    return this._kernels.find(k => k.state === 'waiting' && k.path === path) ?? null;
  }

  /** Poll again now rather than at the next tick. */
  refreshSoon(): void {
    void this._poll.refresh();
  }

  async stopWaiting(kernelId: string): Promise<void> {
    await stopWaiting(kernelId);
    this.refreshSoon();
  }

  /**
   * The GPU kernel a notebook shows: its kernel's record; while its kernel starts, the
   * waiting kernel started for its path; with no kernel, the lease that last ended there.
   */
  forPanel(panel: NotebookPanel | null): IKernelLease | null {
    if (!panel || panel.isDisposed) {
      return null;
    }
    const context = panel.sessionContext;
    const kernel = context.session?.kernel;
    if (kernel) {
      return this._kernels.find(k => k.kernel_id === kernel.id) ?? null;
    }
    const path = context.path;
    const starting = ['initializing', 'starting'].includes(context.kernelDisplayStatus);
    if (starting) {
      return this.waitingFor(path);
    }
    return this.lastEnded(path);
  }

  /**
   * The most recent lease of a notebook when it was revoked or expired (null when the
   * notebook's last lease ended normally: an old revocation is old news then). Unless
   * `evenIfNewer`, only while no newer kernel of that notebook waits or runs (the status
   * bar's choice); a notebook opened again is told anyway (the notification's choice).
   */
  lastEnded(path: string, evenIfNewer = false): IKernelLease | null {
    let last: IKernelLease | null = null;
    for (const k of this._kernels) {
      if (k.path !== path) {
        continue;
      }
      if ((k.state === 'waiting' || k.state === 'active' || isParked(k.state)) && !evenIfNewer) {
        return null;
      }
      if (
        (k.state === 'revoked' || k.state === 'expired' || k.state === 'released') &&
        (!last || (k.ended_at ?? 0) >= (last.ended_at ?? 0))
      ) {
        last = k;
      }
    }
    return last && last.state !== 'released' ? last : null;
  }

  dispose(): void {
    this._poll.dispose();
    Signal.clearData(this);
  }

  private _poll: Poll;
  private _firstSeen = new Map<string, number>();
  private _kernels: IKernelLease[] = [];
  private _changed = new Signal<this, void>(this);
}
