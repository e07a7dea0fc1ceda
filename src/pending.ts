// The one private part of JupyterLab this extension uses, behind a check.
//
// A page reloaded while its notebook's kernel waits for a GPU re-attaches to that kernel
// (src/sessions.ts). Meanwhile the notebook must show the kernel as starting, as the page
// that started it did: otherwise a cell run meanwhile starts a second kernel, and the
// kernel indicator says "No Kernel". JupyterLab's SessionContext has no public way to say
// "a kernel of this name is on its way"; its private `_pendingKernelName` is what its own
// kernel start sets (and what `kernelDisplayName` and `kernelDisplayStatus` read). If a
// JupyterLab release renames it, `showStarting` says so on the console, once, and returns
// false: the re-attach still works, only the notebook shows "No Kernel" while it waits.
// `npm run test:unit` (test/unit/pending.spec.ts) and `tests/test_lab_version.py` fail
// for a JupyterLab without it, before a student meets it.
import { ISessionContext } from '@jupyterlab/apputils';
import { PageConfig } from '@jupyterlab/coreutils';

/** The JupyterLab versions this extension is built and tested for (package.json too). */
export const SUPPORTED_JUPYTERLAB = '>=4.2 <5';

const FIELD = '_pendingKernelName';

interface IPending {
  [FIELD]: unknown;
}

/** Whether this JupyterLab's session contexts have the private field (a string). */
export function hasPendingName(context: ISessionContext): boolean {
  return typeof (context as unknown as IPending)[FIELD] === 'string';
}

let warned = false;

/** The message (and console line) for a JupyterLab without the private field. */
export function missingMessage(): string {
  const version = PageConfig.getOption('appVersion') || 'unknown';
  return (
    `jupyter-gpu-lease: this JupyterLab (${version}) has no SessionContext.${FIELD}, ` +
    `which the extension sets while a reloaded page waits for its kernel's GPU ` +
    `(supported JupyterLab: ${SUPPORTED_JUPYTERLAB}). The waiting kernel is still ` +
    `re-attached, but the notebook shows "No Kernel" until it starts, and a cell run ` +
    `meanwhile may start a second kernel. Upgrade jupyter-gpu-lease, or use a supported ` +
    `JupyterLab.`
  );
}

/**
 * Show `name` as the notebook's starting kernel (until a kernel or `clearStarting`).
 * False, with one console error per page, where this JupyterLab lacks the private field.
 */
export function showStarting(context: ISessionContext, name: string): boolean {
  if (!hasPendingName(context)) {
    if (!warned) {
      warned = true;
      console.error(missingMessage());
    }
    return false;
  }
  const pending = context as unknown as IPending;
  // unset, or JupyterLab's "No Kernel" (what it sets when a session is shut down)
  const noKernel = (context as unknown as { noKernelName?: string }).noKernelName;
  if (!pending[FIELD] || pending[FIELD] === noKernel) {
    pending[FIELD] = name;
  }
  return true;
}

/** The notebook no longer shows a kernel as starting. */
export function clearStarting(context: ISessionContext): void {
  if (hasPendingName(context)) {
    (context as unknown as IPending)[FIELD] = '';
  }
}
