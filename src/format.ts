// Pure text for the status bar and notifications.
import { IKernelLease } from './api';

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
export function aboutWait(seconds: number): string {
  if (seconds < 60) {
    return 'less than a minute';
  }
  const minutes = Math.round(seconds / 60);
  if (minutes < 60) {
    return `about ${minutes} min`;
  }
  const hours = Math.floor(minutes / 60);
  const rest = minutes % 60;
  return rest ? `about ${hours} h ${rest} min` : `about ${hours} h`;
}

/** 0.02 -> "0.02", 0.25 -> "0.25", 1 -> "1". */
export function fraction(f: number): string {
  return String(Number(f.toPrecision(6)));
}

/** The status bar's text for one kernel, or '' for nothing to show. */
export function statusText(k: IKernelLease | null): string {
  if (!k) {
    return '';
  }
  switch (k.state) {
    case 'active': {
      const parts = [`GPU ${fraction(k.lease?.fraction ?? k.fraction)}`];
      if (k.lease?.gpu?.name) {
        parts.push(k.lease.gpu.name);
      }
      if (typeof k.lease?.memory_limit_mb === 'number') {
        parts.push(`cap ${k.lease.memory_limit_mb} MiB`);
      }
      return parts.join(' · ');
    }
    case 'waiting':
      return `GPU queue: ${queuePlace(k)}`;
    case 'revoked':
      return 'GPU lease revoked';
    case 'expired':
      return 'GPU lease expired';
    default:
      return '';
  }
}

/** "3rd of 7 · about 4 min", "3rd of 7", or "waiting" before the broker said more. */
export function queuePlace(k: IKernelLease): string {
  const parts: string[] = [];
  if (k.position) {
    parts.push(k.waiting ? `${ordinal(k.position)} of ${k.waiting}` : ordinal(k.position));
  } else {
    parts.push('waiting');
  }
  if (typeof k.eta_seconds === 'number') {
    parts.push(aboutWait(k.eta_seconds));
  }
  return parts.join(' · ');
}

/** A notebook's file name for messages, else the kernel's name. */
export function label(k: IKernelLease): string {
  if (k.path) {
    const base = k.path.split('/').pop();
    if (base) {
      return base;
    }
  }
  return k.kernel_name ? `the ${k.kernel_name} kernel` : 'Your kernel';
}

/** The waiting notification's sentence. */
export function waitingMessage(k: IKernelLease): string {
  const where = k.position
    ? `${ordinal(k.position)}${k.waiting ? ` of ${k.waiting}` : ''} in the GPU queue`
    : 'in the GPU queue';
  const eta =
    typeof k.eta_seconds === 'number'
      ? ` Estimated wait: ${aboutWait(k.eta_seconds)}.`
      : '';
  return (
    `${label(k)} waits for a GPU (${fraction(k.fraction)} of one): ${where}.${eta} ` +
    'Cells you run now run when the kernel starts.'
  );
}

/** The notification when a lease ends by the broker's decision. */
export function endedMessage(k: IKernelLease): string {
  const how = k.state === 'revoked' ? 'was revoked' : 'expired';
  const why = k.reason ? `: ${k.reason.replace(/\.$/, '')}` : '';
  return (
    `The GPU lease of ${label(k)} ${how}${why}. The kernel was shut down; ` +
    'start it again when you need the GPU.'
  );
}
