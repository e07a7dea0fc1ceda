// Toasts: while a GPU kernel waits (with "Stop waiting"), when its GPU memory is parked, and
// when a lease is revoked or expires.
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';

import { IKernelLease, isParked } from './api';
import {
  endedMessage,
  endedToast,
  fitting,
  fraction,
  label,
  parkedMessage,
  waitingMessage
} from './format';
import { RememberedIds } from './memory';
import { GPULeaseModel } from './model';

export class GPULeaseNotifier {
  constructor(
    private _model: GPULeaseModel,
    private _tracker: INotebookTracker,
    private _trans: TranslationBundle
  ) {
    _model.changed.connect(this._onChanged, this);
    _tracker.currentChanged.connect(this._onPanel, this);
    _tracker.widgetAdded.connect(this._onPanel, this);
  }

  private _onChanged(): void {
    const present = new Set<string>();
    for (const k of this._model.kernels) {
      present.add(k.kernel_id);
      if (k.state === 'waiting') {
        if (this._model.shown(k)) {
          this._waiting(k);
        }
      } else if (k.state === 'active') {
        this._granted(k);
        this._parked.delete(k.kernel_id);
      } else if (isParked(k.state)) {
        this._onParked(k);
      } else if (k.state === 'revoked' || k.state === 'expired') {
        // seen alive in this page, or its notebook is open: tell now
        const open = this._tracker.find(p => p.context.path === k.path);
        const latest = k.path ? this._model.lastEnded(k.path, true) : k;
        if (this._seenLive.has(k.kernel_id) || (open && latest === k)) {
          this._ended(k);
        }
      }
      if (k.state === 'waiting' || k.state === 'active' || isParked(k.state)) {
        this._seenLive.add(k.kernel_id);
      }
    }
    // a waiting kernel that vanished: its start failed or the student stopped waiting
    for (const [kernelId, id] of this._waitingToasts) {
      if (!present.has(kernelId)) {
        Notification.dismiss(id);
        this._waitingToasts.delete(kernelId);
      }
    }
  }

  /** A notebook opened or focused: tell why its last GPU lease ended (unless told). */
  private _onPanel(_: INotebookTracker, panel: NotebookPanel | null): void {
    if (!panel) {
      return;
    }
    void panel.context.ready.then(() => {
      const k = this._model.lastEnded(panel.context.path, true);
      if (k) {
        this._ended(k);
      }
    });
  }

  private _waiting(k: IKernelLease): void {
    const trans = this._trans;
    const message = waitingMessage(k, trans);
    const actions = [
      {
        label: trans.__('Stop waiting'),
        caption: trans.__(
          "Give up this kernel's place in the GPU queue; the kernel does not start."
        ),
        displayType: 'warn' as const,
        callback: () => {
          void this._model.stopWaiting(k.kernel_id).then(
            () => this._gaveUp(k),
            reason => {
              Notification.error(
                trans.__('Could not stop waiting: %1', reason.message ?? String(reason))
              );
            }
          );
        }
      }
    ];
    const id = this._waitingToasts.get(k.kernel_id);
    if (id === undefined) {
      this._waitingToasts.set(
        k.kernel_id,
        Notification.emit(message, 'in-progress', { autoClose: false, actions })
      );
      this._lastText.set(k.kernel_id, message);
    } else if (this._lastText.get(k.kernel_id) !== message) {
      Notification.update({ id, message, type: 'in-progress', autoClose: false, actions });
      this._lastText.set(k.kernel_id, message);
    }
  }

  /**
   * The student stopped waiting: the notebook has no kernel now, on purpose. JupyterLab
   * still counted it as initializing ("No Kernel | Initializing" for good) since the start
   * it began failed; nothing is to start by itself any more.
   */
  private _gaveUp(k: IKernelLease): void {
    const panel = this._tracker.find(p => p.sessionContext.path === k.path);
    const context = panel?.sessionContext;
    if (context && !context.session?.kernel) {
      context.kernelPreference = { ...context.kernelPreference, shouldStart: false };
    }
  }

  /** Tell once per parking (not again until the kernel was active in between). */
  private _onParked(k: IKernelLease): void {
    if (this._parked.has(k.kernel_id)) {
      return;
    }
    this._parked.add(k.kernel_id);
    Notification.info(parkedMessage(k, this._trans), { autoClose: 15000 });
  }

  private _granted(k: IKernelLease): void {
    const id = this._waitingToasts.get(k.kernel_id);
    if (id === undefined) {
      return;
    }
    this._waitingToasts.delete(k.kernel_id);
    const trans = this._trans;
    const share = fraction(k.fraction);
    const gpu = k.lease?.gpu?.name;
    // the broker's grant reaches this page with the next poll, by when the kernel has
    // often started already: say which
    const started = this._tracker.find(p => p.sessionContext.session?.kernel?.id === k.kernel_id);
    const then = started
      ? trans.__('The kernel has started.')
      : trans.__('The kernel is starting.');
    Notification.update({
      id,
      message: fitting(
        gpu
          ? trans.__('%1 got its GPU: %2 of a %3. %4', label(k, trans), share, gpu, then)
          : trans.__('%1 got its GPU: %2 of one. %3', label(k, trans), share, then),
        trans.__('Your kernel got its GPU (%1 of one). %2', share, then)
      ),
      type: 'success',
      autoClose: 5000,
      actions: []
    });
  }

  /**
   * Tell why a lease ended, once in this browser (a reload does not tell it again; the
   * banner above the notebook keeps the whole reason until it is dismissed); never twice
   * on screen at once.
   */
  private _ended(k: IKernelLease): void {
    const waitingId = this._waitingToasts.get(k.kernel_id);
    if (waitingId !== undefined) {
      Notification.dismiss(waitingId);
      this._waitingToasts.delete(k.kernel_id);
    }
    const fresh = !this._told.has(k.kernel_id) && !this._dismissed.has(k.kernel_id);
    this._told.add(k.kernel_id);
    const shown = this._endedToasts.get(k.kernel_id);
    if (!fresh || (shown !== undefined && Notification.manager.has(shown))) {
      return;
    }
    const trans = this._trans;
    const whole = endedMessage(k, trans);
    const short = endedToast(k, trans);
    const actions =
      short === whole
        ? []
        : [
            {
              label: trans.__('Read why'),
              caption: trans.__('The whole message'),
              callback: (event: Event) => {
                event.preventDefault(); // keep the notification
                void showDialog({
                  title:
                    k.state === 'revoked'
                      ? trans.__('GPU lease revoked')
                      : trans.__('GPU lease expired'),
                  body: whole,
                  buttons: [Dialog.okButton({ label: trans.__('OK') })]
                });
              }
            }
          ];
    this._endedToasts.set(k.kernel_id, Notification.warning(short, { autoClose: false, actions }));
  }

  private _waitingToasts = new Map<string, string>();
  private _parked = new Set<string>();
  private _lastText = new Map<string, string>();
  private _endedToasts = new Map<string, string>();
  /** ended leases told (this browser), and those whose banner was dismissed */
  private _told = new RememberedIds('told');
  private _dismissed = new RememberedIds('dismissed');
  private _seenLive = new Set<string>();
}
