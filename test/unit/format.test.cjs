// Unit tests of the extension's text (src/format.ts), with Node's own test runner: what the
// status bar and the notifications say, and that a notification's text fits JupyterLab's
// 140 characters. Run by `npm run test:unit` (compiles src/format.ts to build/unit first).
const test = require('node:test');
const assert = require('node:assert/strict');

const f = require('../../build/unit/format.js');

// JupyterLab's nullTranslator: the English text, %1, %2... replaced by the arguments
const trans = { __: (s, ...args) => s.replace(/%(\d+)/g, (_, i) => String(args[i - 1])) };

const waiting = (extra = {}) => ({
  kernel_id: 'k1',
  state: 'waiting',
  fraction: 0.02,
  path: 'course/Untitled.ipynb',
  ...extra
});

test('ordinals', () => {
  assert.deepEqual([1, 2, 3, 4, 11, 12, 13, 21, 22, 111].map(f.ordinal),
    ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st', '22nd', '111th']);
});

test('estimated waits in words', () => {
  assert.equal(f.aboutWait(30, trans), 'less than a minute');
  assert.equal(f.aboutWait(240, trans), 'about 4 min');
  assert.equal(f.aboutWait(3600, trans), 'about 1 h');
  assert.equal(f.aboutWait(4800, trans), 'about 1 h 20 min');
});

test('the status bar: lease, memory in use, queue place', () => {
  const lease = { id: 'L', fraction: 0.02, state: 'active', memory_limit_mb: 143,
    gpu: { uuid: 'GPU-1', name: 'V100' } };
  const active = { kernel_id: 'k', state: 'active', fraction: 0.02, lease };
  assert.equal(f.statusText(active, trans), 'GPU 0.02 · V100 · cap 143 MiB');
  const used = { ...active, lease: { ...lease, used_mb: 518, memory_limit_mb: 2363 } };
  assert.equal(f.statusText(used, trans), 'GPU 0.02 · 518 / 2,363 MiB');
  assert.deepEqual(f.memoryUse(used), [518, 2363]);
  assert.equal(f.memoryUse(active), null);
  assert.equal(f.statusText(waiting({ position: 2, waiting: 7, eta_seconds: 240 }), trans),
    'GPU queue: 2nd of 7 · about 4 min');
  assert.equal(f.statusText(waiting(), trans), 'GPU queue: waiting');
  assert.equal(f.statusText(null, trans), '');
});

test('the waiting notification is whole within 140 characters', () => {
  const k = waiting({ position: 12, waiting: 140, eta_seconds: 4800 });
  const text = f.waitingMessage(k, trans);
  assert.equal(text, 'Untitled.ipynb waits for a GPU (0.02 of one): 12th of 140 in the GPU ' +
    'queue (about 1 h 20 min). Cells you run now run when it starts.');
  assert.ok(text.length <= f.TOAST_LIMIT);
  const long = waiting({ path: 'x'.repeat(80) + '.ipynb', position: 12, waiting: 140 });
  const short = f.waitingMessage(long, trans);
  assert.ok(short.length <= f.TOAST_LIMIT, short);
  assert.ok(short.startsWith('Your kernel waits for a GPU'), short);
});

test('a revoked lease: the whole reason, and a notification that fits', () => {
  const reason = 'The V100 of node gpu01 is needed for the 18:00 exam of ml101: please save ' +
    'your notebooks now and restart your kernel after 20:00, when the GPU is free again.';
  const k = { kernel_id: 'k', state: 'revoked', fraction: 0.02, path: 'a/b.ipynb', reason };
  const whole = f.endedMessage(k, trans);
  assert.ok(whole.includes(reason.replace(/\.$/, '')), whole);
  assert.ok(whole.endsWith('start it again when you need the GPU.'), whole);
  const toast = f.endedToast(k, trans);
  assert.ok(toast.length <= f.TOAST_LIMIT, toast);
  assert.equal(toast, 'The GPU lease of b.ipynb was revoked, so the kernel was shut down. ' +
    'Read why above the notebook.');
  const brief = { ...k, reason: 'maintenance at 18:00' };
  assert.equal(f.endedToast(brief, trans), f.endedMessage(brief, trans));
});
