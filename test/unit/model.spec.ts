// The browser's view of this server's GPU kernels (src/model.ts): which kernel a notebook
// shows, when a waiting kernel is shown, which ended lease a notebook is told about.
import type { NotebookPanel } from '@jupyterlab/notebook';

import { IKernelLease } from '../../src/api';
import { GPULeaseModel, kernelToAttach, QUIET_MS } from '../../src/model';

const NB = 'course/a.ipynb';

const kernel = (id: string, extra: Partial<IKernelLease> = {}): IKernelLease => ({
  kernel_id: id,
  state: 'waiting',
  fraction: 0.02,
  path: NB,
  ...extra
});

/** JupyterLab's notebook panel, as much of it as the model reads. */
const panel = (opts: { kernelId?: string; status?: string; disposed?: boolean }) =>
  ({
    isDisposed: !!opts.disposed,
    sessionContext: {
      path: NB,
      session: opts.kernelId ? { kernel: { id: opts.kernelId } } : null,
      kernelDisplayStatus: opts.status ?? 'idle'
    }
  }) as unknown as NotebookPanel;

let model: GPULeaseModel;
beforeEach(() => {
  model = new GPULeaseModel(); // never started: no request leaves the test
});
afterEach(() => model.dispose());

describe('a waiting kernel in the status bar', () => {
  it('is shown at once when the broker queued it', () => {
    const queued = kernel('k1', { position: 1, waiting: 1 });
    model.update([queued], 1000);
    expect(model.shown(queued, 1000)).toBe(true);
  });

  it('is not flashed before its lease on a free GPU, but shown after QUIET_MS', () => {
    const k = kernel('k1');
    expect(model.update([k], 1000)).toBe(true); // newly waiting: ask again after QUIET_MS
    expect(model.shown(k, 1000)).toBe(false);
    expect(model.shown(k, 1000 + QUIET_MS - 1)).toBe(false);
    expect(model.update([k], 2000)).toBe(false); // seen since 1000, not again
    expect(model.shown(k, 1000 + QUIET_MS)).toBe(true);
  });

  it('starts its quiet time again when it waits again after a lease', () => {
    const k = kernel('k1');
    model.update([k], 1000);
    model.update([{ ...k, state: 'active' }], 2000);
    expect(model.shown({ ...k, state: 'active' }, 2000)).toBe(true);
    expect(model.update([k], 10_000)).toBe(true);
    expect(model.shown(k, 10_000 + QUIET_MS - 1)).toBe(false);
    expect(model.shown(null)).toBe(false);
  });

  it('tells who listens after each answer', () => {
    let calls = 0;
    model.changed.connect(() => calls++);
    model.update([], 0);
    model.update([kernel('k1')], 1);
    expect(calls).toBe(2);
    expect(model.kernels.map(k => k.kernel_id)).toEqual(['k1']);
  });
});

describe('the kernel a notebook shows', () => {
  const waitingK = kernel('w', { waiting_since: 5 });
  const activeK = kernel('a', { state: 'active' });
  const revokedOld = kernel('r1', { state: 'revoked', ended_at: 10, reason: 'old' });
  const revokedNew = kernel('r2', { state: 'revoked', ended_at: 20, reason: 'new' });

  it('is its own kernel when it has one', () => {
    model.update([waitingK, activeK], 0);
    expect(model.forPanel(panel({ kernelId: 'a' }))).toBe(activeK);
    expect(model.forPanel(panel({ kernelId: 'not-a-gpu-kernel' }))).toBeNull();
  });

  it('is the waiting kernel of its path while its kernel starts', () => {
    model.update([waitingK, revokedNew], 0);
    expect(model.forPanel(panel({ status: 'starting' }))).toBe(waitingK);
    expect(model.waitingFor(NB)).toBe(waitingK);
    expect(model.waitingFor('other.ipynb')).toBeNull();
  });

  it('with no kernel, is the lease that last ended there, unless a newer kernel runs', () => {
    model.update([revokedNew, revokedOld], 0);
    expect(model.forPanel(panel({}))).toBe(revokedNew);
    model.update([revokedOld, activeK, revokedNew], 0);
    expect(model.lastEnded(NB)).toBeNull();
    expect(model.lastEnded(NB, true)).toBe(revokedNew);
    expect(model.lastEnded('other.ipynb', true)).toBeNull();
  });

  it('with no kernel, is nothing once a later kernel of the notebook ended normally', () => {
    const released = kernel('k3', { state: 'released', ended_at: 30 });
    model.update([revokedNew, released, revokedOld], 0);
    expect(model.forPanel(panel({}))).toBeNull();
    expect(model.lastEnded(NB, true)).toBeNull();
    // a revocation after that normal end is news again
    const revokedLater = kernel('r4', { state: 'revoked', ended_at: 40, reason: 'later' });
    model.update([revokedNew, released, revokedLater], 0);
    expect(model.forPanel(panel({}))).toBe(revokedLater);
  });

  it('is nothing for no panel or a closed one', () => {
    model.update([activeK], 0);
    expect(model.forPanel(null)).toBeNull();
    expect(model.forPanel(panel({ kernelId: 'a', disposed: true }))).toBeNull();
  });
});

describe('the kernel a page opening a notebook attaches to', () => {
  const revoked = kernel('r', { state: 'revoked', ended_at: 10 });
  const other = kernel('o', { state: 'active', path: 'other.ipynb' });

  it("is the notebook's waiting kernel first, else one that started meanwhile", () => {
    const waiting = kernel('w');
    const active = kernel('a', { state: 'active' });
    expect(kernelToAttach([revoked, active, waiting, other], NB)).toBe(waiting);
    // started while the page loaded: the page attaches rather than holding the notebook
    expect(kernelToAttach([revoked, active, other], NB)).toBe(active);
    const parked = kernel('p', { state: 'parked' });
    expect(kernelToAttach([revoked, parked], NB)).toBe(parked);
  });

  it("is none for a notebook whose kernels ended or are another notebook's", () => {
    const released = kernel('x', { state: 'released', ended_at: 20 });
    expect(kernelToAttach([revoked, released, other], NB)).toBeNull();
    expect(kernelToAttach([], NB)).toBeNull();
  });
});
