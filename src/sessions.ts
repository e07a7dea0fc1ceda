// A notebook and its GPU kernel's request, from the notebook's side:
//
// - a page opened (or reloaded) while the notebook's kernel waits for its GPU re-attaches
//   to that kernel instead of starting a second one: JupyterLab knows a session only once
//   its kernel has started, so it found none and started another kernel, which joined the
//   queue too;
// - "Shut Down Kernel" (or anything that shuts the notebook's session down) while the
//   kernel waits withdraws its request: JupyterLab had no session to shut down, and the
//   request stayed queued for nobody;
// - a notebook saved with a GPU kernel this user can never start says why, before
//   JupyterLab asks to select another kernel;
// - a lease that ended by the broker's decision: the notebook's session is let go (its
//   kernel was shut down; the indicator said "Idle"), and a banner above the notebook gives
//   the whole reason (a notification shows 140 characters), also after a reload.
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { attachSession, fetchKernels, IKernelLease, whyNotKernel } from './api';
import { DeferredCells } from './deferred';
import { endedMessage } from './format';
import { GPULeaseModel } from './model';

export class NotebookGuard {
  constructor(
    private _model: GPULeaseModel,
    private _tracker: INotebookTracker,
    private _deferred: DeferredCells,
    private _trans: TranslationBundle
  ) {
    _tracker.widgetAdded.connect((_, panel) => this._guard(panel));
    _model.changed.connect(this._onChanged, this);
  }

  private _guard(panel: NotebookPanel): void {
    const context = panel.sessionContext;
    const initialize = context.initialize.bind(context);
    context.initialize = async () => {
      await this._beforeStart(panel);
      return initialize();
    };
    const shutdown = context.shutdown.bind(context);
    context.shutdown = async () => {
      await this._withdraw(panel);
      return shutdown();
    };
    const banner = new Banner(this._trans);
    this._banners.set(panel, banner);
    panel.contentHeader.addWidget(banner);
    panel.disposed.connect(() => this._banners.delete(panel));
    this._showBanner(panel);
  }

  /** Before JupyterLab looks for the notebook's session (and starts a kernel if none). */
  private async _beforeStart(panel: NotebookPanel): Promise<void> {
    const context = panel.sessionContext;
    let kernels: IKernelLease[];
    try {
      kernels = await fetchKernels();
    } catch {
      return; // no GPU lease status here: JupyterLab as usual
    }
    const waiting = kernels.find(k => k.state === 'waiting' && k.path === context.path);
    if (waiting) {
      await this._attach(panel, waiting);
      return;
    }
    await this._explainKernel(panel);
  }

  private async _attach(panel: NotebookPanel, k: IKernelLease): Promise<void> {
    const context = panel.sessionContext;
    // Meanwhile the notebook shows the kernel as starting, as the page that started it
    // did: JupyterLab's session context has no public way to say "a kernel of this name
    // is on its way", and without it a cell run now would start a second kernel.
    const pending = context as unknown as { _pendingKernelName: string };
    if (k.kernel_name && !pending._pendingKernelName) {
      pending._pendingKernelName = k.kernel_name;
    }
    try {
      await attachSession(k.kernel_id, {
        path: context.path,
        name: context.name,
        type: context.type
      });
    } catch (error) {
      // its start failed (stopped waiting, shut down, refused): start nothing else now
      pending._pendingKernelName = '';
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
    }
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

  private _banners = new WeakMap<NotebookPanel, Banner>();
  private _withdrawn = new WeakSet<NotebookPanel>();
}

/** Why the notebook's last GPU lease ended, whole, above the notebook; closable. */
class Banner extends Widget {
  constructor(trans: TranslationBundle) {
    super();
    this.addClass('jp-GPULease-banner');
    this.node.setAttribute('role', 'alert');
    this._text = document.createElement('div');
    this._text.className = 'jp-GPULease-banner-text';
    const close = document.createElement('button');
    close.className = 'jp-Button jp-mod-minimal jp-GPULease-banner-close';
    close.textContent = trans.__('Dismiss');
    close.title = trans.__('Hide this message');
    close.addEventListener('click', () => {
      if (this._kernelId) {
        this._dismissed.add(this._kernelId);
      }
      this.hide();
    });
    this.node.append(this._text, close);
    this.hide();
  }

  showFor(k: IKernelLease | null, text: string): void {
    if (!k || this._dismissed.has(k.kernel_id)) {
      this.hide();
      return;
    }
    this._kernelId = k.kernel_id;
    this.node.dataset.state = k.state;
    if (this._text.textContent !== text) {
      this._text.textContent = text;
      this._fit();
    }
    super.show();
  }

  protected onAfterShow(): void {
    this._fit();
  }

  protected onResize(): void {
    this._fit();
  }

  /** The notebook's header is a BoxPanel, which sizes a child by its CSS minimum only:
   * make that the wrapped text's height, whatever the width. */
  private _fit(): void {
    requestAnimationFrame(() => {
      if (this.isHidden || this.isDisposed) {
        return;
      }
      const style = getComputedStyle(this.node);
      const needed = Math.ceil(
        this._text.getBoundingClientRect().height +
          parseFloat(style.paddingTop) +
          parseFloat(style.paddingBottom) +
          parseFloat(style.borderBottomWidth)
      );
      if (this.node.style.minHeight !== `${needed}px`) {
        this.node.style.minHeight = `${needed}px`;
        this.parent?.fit();
      }
    });
  }

  private _text: HTMLDivElement;
  private _kernelId = '';
  private _dismissed = new Set<string>();
}
