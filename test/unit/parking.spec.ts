// A kernel whose GPU memory the broker parked: the status bar's "GPU parked" and
// "resuming: 2nd in queue", the notification when it is parked, and that a parked kernel
// counts as alive for the notebook (its older ended lease is not shown over it).
import { Notification } from '@jupyterlab/apputils';
import type { INotebookTracker } from '@jupyterlab/notebook';
import { nullTranslator } from '@jupyterlab/translation';
import { Signal } from '@lumino/signaling';

import { IKernelLease, ILease, isParked } from '../../src/api';
import { parkedMessage, parkedText, statusText, TOAST_LIMIT } from '../../src/format';
import { GPULeaseModel } from '../../src/model';
import { GPULeaseNotifier } from '../../src/notifications';

// JupyterLab's toasts (an ES-module package with CSS, which jest does not load): only
// their entry points, so the test sees what the notifier asks to show
jest.mock('@jupyterlab/apputils', () => ({
  Notification: {
    info: jest.fn(() => 'toast'),
    emit: jest.fn(),
    update: jest.fn(),
    dismiss: jest.fn(),
    warning: jest.fn(),
    manager: { has: () => false }
  },
  Dialog: { okButton: jest.fn() },
  showDialog: jest.fn()
}));

const trans = nullTranslator.load('jupyter_gpu_lease');
const NB = 'course/Untitled.ipynb';

const lease: ILease = {
  id: 'L',
  fraction: 0.02,
  state: 'parked',
  memory_limit_mb: 143,
  gpu: { uuid: 'GPU-1', name: 'V100' },
  parked_at: 1000
};
const parked = (extra: Partial<IKernelLease> = {}): IKernelLease => ({
  kernel_id: 'k1',
  state: 'parked',
  fraction: 0.02,
  lease,
  path: NB,
  ...extra
});

describe('a parked kernel in the status bar', () => {
  it('says "GPU parked" while parking and parked, with nobody asking it back', () => {
    expect(statusText(parked(), trans)).toBe('GPU parked');
    expect(statusText(parked({ state: 'parking' }), trans)).toBe('GPU parked');
  });

  it("shows the resume's place in the queue, with the estimated wait when known", () => {
    expect(statusText(parked({ position: 2 }), trans)).toBe('resuming: 2nd in queue');
    expect(statusText(parked({ position: 2, waiting: 5, eta_seconds: 240 }), trans)).toBe(
      'resuming: 2nd in queue · about 4 min'
    );
    expect(parkedText(parked({ state: 'resuming', position: 1, eta_seconds: 10 }), trans)).toBe(
      'resuming: 1st in queue · less than a minute'
    );
  });

  it('says "resuming" while the memory comes back', () => {
    expect(statusText(parked({ state: 'resuming' }), trans)).toBe('resuming');
  });

  it('knows the parked states and no others', () => {
    expect(['parking', 'parked', 'resuming'].every(s => isParked(s))).toBe(true);
    expect(['active', 'waiting', 'revoked', 'released', undefined].some(isParked)).toBe(false);
  });
});

describe('the parked notification', () => {
  it('names the notebook when that fits, else the sentence of the design', () => {
    expect(parkedMessage(parked(), trans)).toBe(
      'The GPU memory of Untitled.ipynb was parked while others waited; running a cell resumes it — variables are kept.'
    );
    const long = parked({ path: 'course/' + 'x'.repeat(80) + '.ipynb' });
    expect(parkedMessage(long, trans)).toBe(
      "Your kernel's GPU memory was parked while others waited; running a cell resumes it — variables are kept."
    );
    expect(parkedMessage(long, trans).length).toBeLessThanOrEqual(TOAST_LIMIT);
  });

  it('is shown once when the kernel is parked, and again after it was active in between', () => {
    const info = Notification.info as jest.Mock;
    const tracker = {
      currentChanged: new Signal<unknown, unknown>({}),
      widgetAdded: new Signal<unknown, unknown>({}),
      find: () => undefined
    } as unknown as INotebookTracker;
    const model = new GPULeaseModel(); // never started: no request leaves the test
    new GPULeaseNotifier(model, tracker, trans);
    const active = parked({ state: 'active', lease: { ...lease, state: 'active' } });
    model.update([active]);
    expect(info).not.toHaveBeenCalled();
    model.update([parked({ state: 'parking' })]);
    model.update([parked()]);
    model.update([parked({ position: 2 })]);
    expect(info).toHaveBeenCalledTimes(1);
    expect(info.mock.calls[0][0]).toContain('was parked while others waited');
    model.update([active]);
    model.update([parked()]);
    expect(info).toHaveBeenCalledTimes(2);
    model.dispose();
  });
});

describe('a parked kernel is alive for its notebook', () => {
  it("hides the notebook's older revoked lease from the status bar", () => {
    const model = new GPULeaseModel();
    const revoked: IKernelLease = { ...parked(), kernel_id: 'old', state: 'revoked', ended_at: 5 };
    model.update([revoked, parked()]);
    expect(model.lastEnded(NB)).toBeNull();
    expect(model.lastEnded(NB, true)).toBe(revoked);
    model.dispose();
  });
});
