// Pure text for the status bar and notifications.
import { TranslationBundle } from '@jupyterlab/translation';

import { IKernelLease, IOutlook } from './api';

/** 1 -> "1st", 2 -> "2nd", 3 -> "3rd", 11 -> "11th", 22 -> "22nd". */
export function ordinal(n: number): string {
  const tens = n % 100;
  if (tens >= 11 && tens <= 13) {
    return `${n}th`;
  }
  switch (n % 10) {
    case 1:
      return `${n}st`;
    case 2:
      return `${n}nd`;
    case 3:
      return `${n}rd`;
    default:
      return `${n}th`;
  }
}

/** An estimated wait in words: "about 4 min", "about 1 h 20 min", "less than a minute". */
export function aboutWait(seconds: number, trans: TranslationBundle): string {
  if (seconds < 60) {
    return trans.__('less than a minute');
  }
  const minutes = Math.round(seconds / 60);
  if (minutes < 60) {
    return trans.__('about %1 min', minutes);
  }
  const hours = Math.floor(minutes / 60);
  const rest = minutes % 60;
  return rest ? trans.__('about %1 h %2 min', hours, rest) : trans.__('about %1 h', hours);
}

/** 0.02 -> "0.02", 0.25 -> "0.25", 1 -> "1". */
export function fraction(f: number): string {
  return String(Number(f.toPrecision(6)));
}

/** JupyterLab cuts a notification's message after this many characters (with "…"). */
export const TOAST_LIMIT = 140;

/** 2363 -> "2,363" (MiB figures read at a glance). */
export function mib(n: number): string {
  return Math.round(n).toLocaleString('en-US');
}

/** Share of the cap in use from which the status bar turns to its warning colour. */
export const MEMORY_WARNING = 0.9;

/** The lease's memory in use, when the node agent reported it: [used, cap] in MiB. */
export function memoryUse(k: IKernelLease | null): [number, number] | null {
  const used = k?.lease?.used_mb;
  const cap = k?.lease?.memory_limit_mb;
  return typeof used === 'number' && typeof cap === 'number' ? [used, cap] : null;
}

/** The status bar's text for one kernel, or '' for nothing to show. */
export function statusText(k: IKernelLease | null, trans: TranslationBundle): string {
  if (!k) {
    return '';
  }
  switch (k.state) {
    case 'active': {
      const parts = [trans.__('GPU %1', fraction(k.lease?.fraction ?? k.fraction))];
      const use = memoryUse(k);
      if (use) {
        parts.push(trans.__('%1 / %2 MiB', mib(use[0]), mib(use[1])));
      } else {
        if (k.lease?.gpu?.name) {
          parts.push(k.lease.gpu.name);
        }
        if (typeof k.lease?.memory_limit_mb === 'number') {
          parts.push(trans.__('cap %1 MiB', k.lease.memory_limit_mb));
        }
      }
      if (k.lease?.session) {
        // a member's class session (the broker's sentence): "GPU reserved for ml101 until 11:30"
        parts.push(k.lease.session);
      }
      return parts.join(' · ');
    }
    case 'waiting':
      return trans.__('GPU queue: %1', queuePlace(k, trans));
    case 'parking':
    case 'parked':
    case 'resuming':
      return parkedText(k, trans);
    case 'revoked':
      return trans.__('GPU lease revoked');
    case 'expired':
      return trans.__('GPU lease expired');
    default:
      return '';
  }
}

/** "3rd of 7 · about 4 min", "3rd of 7", or "waiting" before the broker said more. */
export function queuePlace(k: IKernelLease, trans: TranslationBundle): string {
  const parts: string[] = [];
  if (k.position) {
    parts.push(
      k.waiting ? trans.__('%1 of %2', ordinal(k.position), k.waiting) : ordinal(k.position)
    );
  } else {
    parts.push(trans.__('waiting'));
  }
  if (typeof k.eta_seconds === 'number') {
    parts.push(aboutWait(k.eta_seconds, trans));
  }
  return parts.join(' · ');
}

/**
 * A parked kernel in the status bar: "GPU parked" while its memory is (being) parked and
 * nobody asked for it back; "resuming: 2nd in queue · about 4 min" while its resume waits
 * (parked with a place in the queue, or resuming); "resuming" while the memory comes back.
 */
export function parkedText(k: IKernelLease, trans: TranslationBundle): string {
  if (k.position) {
    const place = trans.__('%1 in queue', ordinal(k.position));
    return typeof k.eta_seconds === 'number'
      ? trans.__('resuming: %1 · %2', place, aboutWait(k.eta_seconds, trans))
      : trans.__('resuming: %1', place);
  }
  return k.state === 'resuming' ? trans.__('resuming') : trans.__('GPU parked');
}

/** The notification when a kernel's GPU memory was parked. */
export function parkedMessage(k: IKernelLease, trans: TranslationBundle): string {
  const tail = trans.__('running a cell resumes it — variables are kept.');
  return fitting(
    trans.__('The GPU memory of %1 was parked while others waited; %2', label(k, trans), tail),
    trans.__("Your kernel's GPU memory was parked while others waited; %1", tail)
  );
}

/** A notebook's file name for messages, else the kernel's name. */
export function label(k: IKernelLease, trans: TranslationBundle): string {
  if (k.path) {
    const base = k.path.split('/').pop();
    if (base) {
      return base;
    }
  }
  return k.kernel_name ? trans.__('the %1 kernel', k.kernel_name) : trans.__('Your kernel');
}

/** The first of ``candidates`` that JupyterLab shows whole in a notification. */
export function fitting(...candidates: string[]): string {
  return candidates.find(c => c.length <= TOAST_LIMIT) ?? candidates[candidates.length - 1];
}

/** The waiting notification's sentence: whole in a notification (at most 140 characters). */
export function waitingMessage(k: IKernelLease, trans: TranslationBundle): string {
  const where = k.position
    ? k.waiting
      ? trans.__('%1 of %2 in the GPU queue', ordinal(k.position), k.waiting)
      : trans.__('%1 in the GPU queue', ordinal(k.position))
    : trans.__('in the GPU queue');
  const eta = typeof k.eta_seconds === 'number' ? ` (${aboutWait(k.eta_seconds, trans)})` : '';
  const name = label(k, trans);
  const share = fraction(k.fraction);
  const cells = trans.__('Cells you run now run when it starts.');
  return fitting(
    trans.__('%1 waits for a GPU (%2 of one): %3%4.', name, share, where, eta) + ' ' + cells,
    trans.__('Your kernel waits for a GPU (%1 of one): %2%3.', share, where, eta) + ' ' + cells,
    trans.__('Your kernel waits for a GPU: %1.', where) + ' ' + cells
  );
}

/** What ended a lease, in a few words: "was revoked", "expired". */
function how(k: IKernelLease, trans: TranslationBundle): string {
  return k.state === 'revoked' ? trans.__('was revoked') : trans.__('expired');
}

/** The whole sentence when a lease ends by the broker's decision (the banner, "Read why"). */
export function endedMessage(k: IKernelLease, trans: TranslationBundle): string {
  const why = k.reason ? `: ${k.reason.replace(/\.$/, '')}` : '';
  return (
    trans.__('The GPU lease of %1 %2%3.', label(k, trans), how(k, trans), why) +
    ' ' +
    trans.__('The kernel was shut down; start it again when you need the GPU.')
  );
}

/** The notification when a lease ends: the whole sentence if it fits, else a short one
 * (the whole one is behind its "Read why" button and above the notebook). */
export function endedToast(k: IKernelLease, trans: TranslationBundle): string {
  const whole = endedMessage(k, trans);
  return fitting(
    whole,
    trans.__(
      'The GPU lease of %1 %2, so the kernel was shut down.',
      label(k, trans),
      how(k, trans)
    ) + (k.reason ? ' ' + trans.__('Read why above the notebook.') : ''),
    trans.__('A GPU lease %1, so its kernel was shut down.', how(k, trans))
  );
}

/**
 * What starting a GPU kernel would take now, as the banner of a notebook opened without
 * starting it says: "GPU 1 · 100 % of a V100 · free now", "GPU 0.02 · 2 % of a V100 · 2nd
 * in queue"; without the server's outlook only "GPU 0.02".
 */
export function outlookText(f: number, outlook: IOutlook | null, trans: TranslationBundle): string {
  const parts = [trans.__('GPU %1', fraction(f))];
  const percent = fraction(Number((f * 100).toPrecision(4)));
  parts.push(
    outlook?.gpu_name
      ? trans.__('%1 % of a %2', percent, outlook.gpu_name)
      : trans.__('%1 % of a GPU', percent)
  );
  if (outlook?.free_now) {
    parts.push(trans.__('free now'));
  } else if (outlook?.position) {
    parts.push(trans.__('%1 in queue', ordinal(outlook.position)));
  }
  if (outlook?.session) {
    // a class session held now (the server's sentence names the course and its end)
    parts.push(outlook.session);
  }
  return parts.join(' · ');
}
