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

  /** A notebook opened or focused again: tell why its last GPU lease ended. */
  private _onPanel(_: INotebookTracker, panel: NotebookPanel | null): void {
    if (!panel) {
      return;
    }
    void panel.context.ready.then(() => {
      const k = this._model.lastEnded(panel.context.path, true);
      if (k) {
        this._ended(k, panel);
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
          void this._model.stopWaiting(k.kernel_id).catch(reason => {
            Notification.error(
              trans.__('Could not stop waiting: %1', reason.message ?? String(reason))
            );
          });
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
    Notification.update({
      id,
      message: fitting(
        gpu
          ? trans.__(
              '%1 got its GPU: %2 of a %3. The kernel is starting.',
              label(k, trans),
              share,
              gpu
            )
          : trans.__('%1 got its GPU: %2 of one. The kernel is starting.', label(k, trans), share),
        trans.__('Your kernel got its GPU (%1 of one). The kernel is starting.', share)
      ),
      type: 'success',
      autoClose: 5000,
      actions: []
    });
  }

  /**
   * Tell why a lease ended: once in this page, and once more each time its notebook is
   * opened again (a new panel); never twice on screen at once.
   */
  private _ended(k: IKernelLease, panel?: NotebookPanel): void {
    const waitingId = this._waitingToasts.get(k.kernel_id);
    if (waitingId !== undefined) {
      Notification.dismiss(waitingId);
      this._waitingToasts.delete(k.kernel_id);
    }
    panel = panel ?? this._tracker.find(p => p.context.path === k.path);
    const toldPanel = panel ? (this._toldPanels.get(panel) ?? new Set<string>()) : null;
    const fresh = panel ? !toldPanel!.has(k.kernel_id) : !this._toldPage.has(k.kernel_id);
    this._toldPage.add(k.kernel_id);
    if (panel && toldPanel) {
      toldPanel.add(k.kernel_id);
      this._toldPanels.set(panel, toldPanel);
    }
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
  private _toldPage = new Set<string>();
  private _seenLive = new Set<string>();
  private _toldPanels = new WeakMap<NotebookPanel, Set<string>>();
}
