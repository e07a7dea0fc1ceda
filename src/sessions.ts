// A notebook and its GPU kernel's request, from the notebook's side:
//
// - a page opened (or reloaded) while the notebook's kernel waits for its GPU re-attaches
//   to that kernel instead of starting a second one: JupyterLab knows a session only once
//   its kernel has started, so it found none and started another kernel, which joined the
//   queue too; cells this tab ran while it waited wait again (src/deferred.ts). The same
//   for a kernel whose GPU came while the page loaded: attaching only to a waiting one,
//   the page held the notebook ("No Kernel") while its kernel ran unseen;
// - a notebook saved with a GPU kernel opens without starting it (unless the setting
//   startGpuKernelsOnOpen says to): a banner says what starting it would take and offers
//   Start. JupyterLab starts a notebook's kernel whenever it opens it, also when it
//   restores the last layout at login: in a class each re-login took a GPU share or a
//   place in the queue for nobody at the keyboard. A notebook made from the launcher
//   (its file names no kernel yet) and CPU kernels start as before;
// - "Shut Down Kernel" (or anything that shuts the notebook's session down) while the
//   kernel waits withdraws its request: JupyterLab had no session to shut down, and the
//   request stayed queued for nobody;
// - a notebook saved with a GPU kernel this user can never start says why, before
//   JupyterLab asks to select another kernel;
// - a lease that ended by the broker's decision: the notebook's session is let go (its
//   kernel was shut down; the indicator said "Idle"), and a banner above the notebook gives
//   the whole reason (a notification shows 140 characters), also after a reload, until
//   it is dismissed or a later kernel of the notebook ends normally.
import { Dialog, ISessionContext, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';

import { attachSession, fetchKernels, gpuFraction, IKernelLease, whyNotKernel } from './api';
import { EndedBanner, HeldBanner } from './banners';
import { DeferredCells } from './deferred';
import { endedMessage } from './format';
import { GPULeaseModel, kernelToAttach } from './model';
import { clearStarting, showStarting } from './pending';

/** A notebook's GPU kernel not started on opening. */
interface IHeld {
  name: string;
  display: string;
  fraction: number;
  preference: ISessionContext.IKernelPreference;
}

export class NotebookGuard {
  constructor(
    private _model: GPULeaseModel,
    private _tracker: INotebookTracker,
    private _deferred: DeferredCells,
    private _trans: TranslationBundle,
    private _startOnOpen: () => Promise<boolean> = async () => false
  ) {
    _tracker.widgetAdded.connect((_, panel) => this._guard(panel));
    _model.changed.connect(this._onChanged, this);
  }

  private _guard(panel: NotebookPanel): void {
    const context = panel.sessionContext;
    const initialize = context.initialize.bind(context);
    const shutdown = context.shutdown.bind(context);
    context.initialize = async () => {
      const held = await this._beforeStart(panel);
      const result = await initialize();
      const kernel = context.session?.kernel;
      if (held && !kernel) {
        this._hold(panel, held);
        // JupyterLab's own "No Kernel" (as when a student picks it): without this its
        // kernel status stayed "Initializing", the last status it was told
        await shutdown();
      } else if (held) {
        context.kernelPreference = held.preference; // it had a session: nothing held
      }
      if (kernel) {
        // started while this tab was reloaded: the cells it kept for that kernel run now
        this._deferred.restore(panel, kernel.id, true);
      }
      return result;
    };
    context.shutdown = async () => {
      await this._withdraw(panel);
      return shutdown();
    };
    const banner = new EndedBanner(this._trans);
    this._banners.set(panel, banner);
    panel.contentHeader.addWidget(banner);
    panel.disposed.connect(() => this._banners.delete(panel));
    this._showBanner(panel);
  }

  /**
   * Before JupyterLab looks for the notebook's session (and starts a kernel if none). The
   * kernel it would start when it is a GPU kernel held until the student asks, else null.
   */
  private async _beforeStart(panel: NotebookPanel): Promise<IHeld | null> {
    const context = panel.sessionContext;
    let kernels: IKernelLease[];
    try {
      kernels = await fetchKernels();
    } catch {
      return null; // no GPU lease status here: JupyterLab as usual
    }
    const started = kernelToAttach(kernels, context.path);
    if (started && (await this._attach(panel, started))) {
      return null;
    }
    const held = await this._toHold(panel);
    if (held) {
      // JupyterLab still connects to a session of the notebook's path, if there is one
      context.kernelPreference = { ...held.preference, shouldStart: false };
      return held;
    }
    await this._explainKernel(panel);
    return null;
  }

  /** The notebook's saved kernel, when it is a GPU kernel JupyterLab is about to start. */
  private async _toHold(panel: NotebookPanel): Promise<IHeld | null> {
    const context = panel.sessionContext;
    const preference = context.kernelPreference;
    const name = preference.name;
    // a notebook made from the launcher names no kernel in its file yet: the student chose
    if (
      !name ||
      name !== panel.context.model.defaultKernelName ||
      preference.id ||
      preference.shouldStart === false ||
      preference.canStart === false ||
      this._asked.has(context.path)
    ) {
      return null;
    }
    let startOnOpen = false;
    try {
      startOnOpen = await this._startOnOpen();
    } catch {
      // settings unavailable: hold (the default)
    }
    if (startOnOpen) {
      return null;
    }
    await context.specsManager.ready;
    const spec = context.specsManager.specs?.kernelspecs[name];
    const fraction = gpuFraction(spec);
    if (!spec || fraction === null) {
      return null; // a CPU kernel, or one this user cannot start (_explainKernel says why)
    }
    return { name, display: spec.display_name || name, fraction, preference };
  }

  /** Show what starting the held kernel would take, and Start; gone once a kernel runs. */
  private _hold(panel: NotebookPanel, held: IHeld): void {
    const context = panel.sessionContext;
    const start = () => {
      this._asked.add(context.path);
      context.kernelPreference = held.preference;
      context.changeKernel({ name: held.name }).catch(() => {
        // JupyterLab shows "Error Starting Kernel" with the broker's sentence
      });
    };
    const banner = new HeldBanner(this._trans, held, start);
    panel.contentHeader.insertWidget(0, banner);
    const onKernel = () => {
      if (context.session?.kernel || context.kernelDisplayStatus === 'starting') {
        banner.dispose();
        context.kernelPreference = held.preference;
        context.kernelChanged.disconnect(onKernel);
        context.statusChanged.disconnect(onKernel);
      }
    };
    context.kernelChanged.connect(onKernel);
    context.statusChanged.connect(onKernel);
    banner.show();
  }

  /**
   * Make `k`'s session the notebook's (waiting until a waiting kernel has started), and
   * JupyterLab's list of sessions current, so that its `initialize` connects to it. False
   * when a started kernel is gone meanwhile: the notebook opens as if it had none.
   */
  private async _attach(panel: NotebookPanel, k: IKernelLease): Promise<boolean> {
    const context = panel.sessionContext;
    const waiting = k.state === 'waiting';
    // Meanwhile the notebook shows the kernel as starting, as the page that started it
    // did (src/pending.ts): without it a cell run now would start a second kernel.
    if (k.kernel_name) {
      showStarting(context, k.kernel_name);
    }
    this._deferred.restore(panel, k.kernel_id);
    try {
      await attachSession(k.kernel_id, {
        path: context.path,
        name: context.name,
        type: context.type
      });
    } catch (error) {
      clearStarting(context);
      if (!waiting) {
        return false; // ended meanwhile: the notebook opens as if it had no kernel
      }
      // its start failed (stopped waiting, shut down, refused): start nothing else now
      context.kernelPreference = { ...context.kernelPreference, shouldStart: false };
      void context.ready.then(() => this._deferred.notRun(panel));
      if (!this._withdrawn.delete(panel)) {
        const message = (error as Error).message ?? String(error);
        void showDialog({
          title: this._trans.__('Error Starting Kernel'),
          body: message,
          buttons: [Dialog.okButton({ label: this._trans.__('Ok') })]
        });
      }
      return true;
    }
    try {
      // JupyterLab finds the session in its own list of sessions, which may predate it
      await context.sessionManager.refreshRunning();
    } catch {
      // its next poll brings it
    }
    return true;
  }

  /** The notebook's kernelspec is one this user can never start: say why. */
  private async _explainKernel(panel: NotebookPanel): Promise<void> {
    const context = panel.sessionContext;
    const name = context.kernelPreference.name;
    if (!name) {
      return;
    }
    await context.specsManager.ready;
    if (context.specsManager.specs?.kernelspecs[name]) {
      return;
    }
    const why = await whyNotKernel(name);
    if (!why || panel.isDisposed) {
      return;
    }
    await showDialog({
      title: this._trans.__('Kernel not available to you'),
      body: why.message,
      buttons: [Dialog.okButton({ label: this._trans.__('Choose another kernel') })]
    });
  }

  /** The notebook's session is shut down: a kernel still waiting gives up its request. */
  private async _withdraw(panel: NotebookPanel): Promise<void> {
    const context = panel.sessionContext;
    if (context.session?.kernel) {
      return; // a started kernel releases its lease when it shuts down
    }
    try {
      await this._model.refresh();
    } catch {
      return;
    }
    const k = this._model.waitingFor(context.path);
    if (k) {
      this._withdrawn.add(panel);
      try {
        await this._model.stopWaiting(k.kernel_id);
      } catch {
        // it started or ended meanwhile: the shutdown that follows does the rest
      }
    }
  }

  private _onChanged(): void {
    const ended = new Map<string, IKernelLease>();
    for (const k of this._model.kernels) {
      if (k.state === 'revoked' || k.state === 'expired') {
        ended.set(k.kernel_id, k);
      }
    }
    this._tracker.forEach(panel => {
      const session = panel.sessionContext.session;
      const kernelId = session?.kernel?.id;
      if (session && kernelId && ended.has(kernelId)) {
        // its kernel was shut down with the lease: no kernel now, not "Idle"
        session.dispose();
      }
      this._showBanner(panel);
    });
  }

  private _showBanner(panel: NotebookPanel): void {
    const banner = this._banners.get(panel);
    if (!banner || panel.isDisposed) {
      return;
    }
    const k = this._model.lastEnded(panel.sessionContext.path);
    banner.showFor(k, k ? endedMessage(k, this._trans) : '');
  }

  private _banners = new WeakMap<NotebookPanel, EndedBanner>();
  private _withdrawn = new WeakSet<NotebookPanel>();
  /** notebooks whose GPU kernel the student started in this page */
  private _asked = new Set<string>();
}
