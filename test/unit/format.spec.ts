// The extension's text (src/format.ts): what the status bar and the notifications say, and
// that a notification's text fits JupyterLab's 140 characters.
import { nullTranslator } from '@jupyterlab/translation';

import { IKernelLease, ILease, IOutlook } from '../../src/api';
import {
  aboutWait,
  endedMessage,
  endedToast,
  fitting,
  fraction,
  label,
  memoryUse,
  mib,
  ordinal,
  outlookText,
  queuePlace,
  statusText,
  TOAST_LIMIT,
  waitingMessage
} from '../../src/format';

// JupyterLab's own translator with no language pack: the English text, %1, %2... filled in
const trans = nullTranslator.load('jupyter_gpu_lease');

const waiting = (extra: Partial<IKernelLease> = {}): IKernelLease => ({
  kernel_id: 'k1',
  state: 'waiting',
  fraction: 0.02,
  path: 'course/Untitled.ipynb',
  ...extra
});

const lease: ILease = {
  id: 'L',
  fraction: 0.02,
  state: 'active',
  memory_limit_mb: 143,
  gpu: { uuid: 'GPU-1', name: 'V100' }
};
const active: IKernelLease = { kernel_id: 'k', state: 'active', fraction: 0.02, lease };

describe('numbers in words', () => {
  it('writes ordinals', () => {
    expect([1, 2, 3, 4, 11, 12, 13, 21, 22, 111, 112].map(ordinal)).toEqual([
      '1st',
      '2nd',
      '3rd',
      '4th',
      '11th',
      '12th',
      '13th',
      '21st',
      '22nd',
      '111th',
      '112th'
    ]);
  });

  it('writes estimated waits', () => {
    expect(aboutWait(0, trans)).toBe('less than a minute');
    expect(aboutWait(59, trans)).toBe('less than a minute');
    expect(aboutWait(60, trans)).toBe('about 1 min');
    expect(aboutWait(240, trans)).toBe('about 4 min');
    expect(aboutWait(3600, trans)).toBe('about 1 h');
    expect(aboutWait(4800, trans)).toBe('about 1 h 20 min');
  });

  it('writes fractions and MiB', () => {
    expect(fraction(0.02)).toBe('0.02');
    expect(fraction(0.1 + 0.2)).toBe('0.3');
    expect(fraction(1)).toBe('1');
    expect(mib(2363)).toBe('2,363');
    expect(mib(517.6)).toBe('518');
  });
});

describe('the status bar', () => {
  it('shows the lease: fraction, GPU and cap while no use was reported', () => {
    expect(statusText(active, trans)).toBe('GPU 0.02 · V100 · cap 143 MiB');
    expect(memoryUse(active)).toBeNull();
  });

  it('shows the memory in use once the node agent reported it', () => {
    const used = { ...active, lease: { ...lease, used_mb: 518, memory_limit_mb: 2363 } };
    expect(statusText(used, trans)).toBe('GPU 0.02 · 518 / 2,363 MiB');
    expect(memoryUse(used)).toEqual([518, 2363]);
    // the agent said nothing yet (null): the cap, not "null / 2,363"
    const unknown = { ...active, lease: { ...lease, used_mb: null } };
    expect(memoryUse(unknown)).toBeNull();
    expect(statusText(unknown, trans)).toBe('GPU 0.02 · V100 · cap 143 MiB');
  });

  it("shows a member's class session", () => {
    const member = {
      ...active,
      lease: { ...lease, session: 'GPU reserved for ml101 until 11:30' }
    };
    expect(statusText(member, trans)).toBe(
      'GPU 0.02 · V100 · cap 143 MiB · GPU reserved for ml101 until 11:30'
    );
  });

  it("says a class session's reserved share where a GPU kernel would start", () => {
    const outlook: IOutlook = {
      name: 'ml101-gpu',
      display_name: 'GPU 0.02',
      fraction: 0.02,
      gpu_name: 'V100',
      free_now: true,
      session: 'GPU reserved for ml101 until 11:30'
    };
    expect(outlookText(0.02, outlook, trans)).toBe(
      'GPU 0.02 · 2 % of a V100 · free now · GPU reserved for ml101 until 11:30'
    );
  });

  it('shows the queue place', () => {
    expect(statusText(waiting({ position: 2, waiting: 7, eta_seconds: 240 }), trans)).toBe(
      'GPU queue: 2nd of 7 · about 4 min'
    );
    expect(queuePlace(waiting({ position: 3 }), trans)).toBe('3rd');
    expect(statusText(waiting(), trans)).toBe('GPU queue: waiting');
  });

  it('says how a lease ended, and nothing for no kernel or a released one', () => {
    expect(statusText({ ...active, state: 'revoked' }, trans)).toBe('GPU lease revoked');
    expect(statusText({ ...active, state: 'expired' }, trans)).toBe('GPU lease expired');
    expect(statusText({ ...active, state: 'released' }, trans)).toBe('');
    expect(statusText(null, trans)).toBe('');
  });
});

describe('notifications', () => {
  it('names the notebook, else the kernel', () => {
    expect(label(waiting(), trans)).toBe('Untitled.ipynb');
    expect(label(waiting({ path: undefined, kernel_name: 'gpu-small' }), trans)).toBe(
      'the gpu-small kernel'
    );
    expect(label(waiting({ path: undefined }), trans)).toBe('Your kernel');
  });

  it('keeps the waiting notification whole within 140 characters', () => {
    const text = waitingMessage(waiting({ position: 12, waiting: 140, eta_seconds: 4800 }), trans);
    expect(text).toBe(
      'Untitled.ipynb waits for a GPU (0.02 of one): 12th of 140 in the GPU ' +
        'queue (about 1 h 20 min). Cells you run now run when it starts.'
    );
    expect(text.length).toBeLessThanOrEqual(TOAST_LIMIT);
    const long = waiting({ path: 'x'.repeat(80) + '.ipynb', position: 12, waiting: 140 });
    const short = waitingMessage(long, trans);
    expect(short.length).toBeLessThanOrEqual(TOAST_LIMIT);
    expect(short.startsWith('Your kernel waits for a GPU')).toBe(true);
  });

  it('gives a revoked lease its whole reason, and a toast that fits', () => {
    const reason =
      'The V100 of node gpu01 is needed for the 18:00 exam of ml101: please save ' +
      'your notebooks now and restart your kernel after 20:00, when the GPU is free again.';
    const k: IKernelLease = {
      kernel_id: 'k',
      state: 'revoked',
      fraction: 0.02,
      path: 'a/b.ipynb',
      reason
    };
    const whole = endedMessage(k, trans);
    expect(whole).toContain(reason.replace(/\.$/, ''));
    expect(whole.endsWith('start it again when you need the GPU.')).toBe(true);
    const toast = endedToast(k, trans);
    expect(toast.length).toBeLessThanOrEqual(TOAST_LIMIT);
    expect(toast).toBe(
      'The GPU lease of b.ipynb was revoked, so the kernel was shut down. ' +
        'Read why above the notebook.'
    );
    const brief = { ...k, reason: 'maintenance at 18:00' };
    expect(endedToast(brief, trans)).toBe(endedMessage(brief, trans));
    const expired = { ...k, state: 'expired' as const, reason: undefined };
    expect(endedMessage(expired, trans)).toBe(
      'The GPU lease of b.ipynb expired. The kernel was shut down; start it again when you ' +
        'need the GPU.'
    );
  });

  it('falls back to the last candidate when none fits', () => {
    const long = 'y'.repeat(TOAST_LIMIT + 1);
    expect(fitting('short', long)).toBe('short');
    expect(fitting(long + 'a', long)).toBe(long);
  });
});
