// The status-bar item: the current notebook's GPU lease, or its place in the GPU queue.
import { INotebookTracker } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { IKernelLease } from './api';
import { aboutWait, statusText } from './format';
import { GPULeaseModel } from './model';

export class GPULeaseStatus extends Widget {
  constructor(
    private _model: GPULeaseModel,
    private _tracker: INotebookTracker
  ) {
    super();
    this.addClass('jp-GPULease-status');
    this.node.setAttribute('role', 'status');
    _model.changed.connect(this.update, this);
    _tracker.currentChanged.connect(this._watchPanel, this);
    this._watchPanel();
  }

  /** The record shown now (tests and notifications read the same choice). */
  get current(): IKernelLease | null {
    return this._model.forPanel(this._tracker.currentWidget);
  }

  protected onUpdateRequest(): void {
    const k = this.current;
    const text = statusText(k);
    this.node.textContent = text;
    this.node.dataset.state = k?.state ?? '';
    this.node.title = k ? this._title(k) : '';
    this.setHidden(!text);
  }

  private _title(k: IKernelLease): string {
    switch (k.state) {
      case 'active':
        return (
          `GPU lease ${k.lease?.id ?? ''} on ${k.lease?.gpu?.name ?? 'a GPU'} ` +
          `${k.lease?.gpu?.uuid ?? ''}: ${k.fraction} of the GPU, ` +
          `${k.lease?.memory_limit_mb ?? '?'} MiB for your tensors. Run %gpu for details.`
        );
      case 'waiting':
        return (
          'This kernel waits for a GPU: the number is its place in the queue' +
          (typeof k.eta_seconds === 'number'
            ? `; the broker estimates ${aboutWait(k.eta_seconds)} from how long leases are held.`
            : '.')
        );
      default:
        return k.reason ?? '';
    }
  }

  private _watchPanel(): void {
    const panel = this._tracker.currentWidget;
    if (this._watched === panel) {
      this.update();
      return;
    }
    if (this._watched && !this._watched.isDisposed) {
      this._watched.sessionContext.statusChanged.disconnect(this.update, this);
      this._watched.sessionContext.kernelChanged.disconnect(this.update, this);
    }
    this._watched = panel;
    if (panel) {
      panel.sessionContext.statusChanged.connect(this.update, this);
      panel.sessionContext.kernelChanged.connect(this.update, this);
    }
    this.update();
  }

  private _watched: typeof this._tracker.currentWidget = null;
}
