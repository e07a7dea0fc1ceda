// The status-bar item: the current notebook's GPU lease (with its memory in use, when the
// node agent reports it), or its place in the GPU queue.
import { INotebookTracker } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { IKernelLease, isParked } from './api';
import { aboutWait, MEMORY_WARNING, memoryUse, mib, statusText } from './format';
import { GPULeaseModel } from './model';

export class GPULeaseStatus extends Widget {
  constructor(
    private _model: GPULeaseModel,
    private _tracker: INotebookTracker,
    private _trans: TranslationBundle
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
    const k = this._model.forPanel(this._tracker.currentWidget);
    return this._model.shown(k) ? k : null;
  }

  protected onUpdateRequest(): void {
    const k = this.current;
    const text = statusText(k, this._trans);
    this.node.textContent = text;
    this.node.dataset.state = k?.state ?? '';
    this.node.dataset.parked = isParked(k?.state) ? 'yes' : '';
    const use = memoryUse(k);
    this.node.dataset.memory = use ? (use[0] >= MEMORY_WARNING * use[1] ? 'high' : 'ok') : '';
    this.node.title = k ? this._title(k) : '';
    this.setHidden(!text);
  }

  private _title(k: IKernelLease): string {
    const trans = this._trans;
    switch (k.state) {
      case 'active': {
        const lease = k.lease;
        const lines = [
          trans.__(
            'GPU lease %1 on %2 %3: %4 of the GPU, %5 MiB for your tensors.',
            lease?.id ?? '',
            lease?.gpu?.name ?? trans.__('a GPU'),
            lease?.gpu?.uuid ?? '',
            k.fraction,
            lease?.memory_limit_mb ?? '?'
          )
        ];
        const use = memoryUse(k);
        if (use) {
          lines.push(
            trans.__(
              'In use at the last report of the node: %1 of %2 MiB.',
              mib(use[0]),
              mib(use[1])
            )
          );
          if (use[0] > use[1]) {
            lines.push(
              trans.__(
                'That is above the cap: free memory (del, torch.cuda.empty_cache()) before the administrator revokes the lease.'
              )
            );
          } else if (use[0] >= MEMORY_WARNING * use[1]) {
            lines.push(trans.__('Near the cap: the next allocation may fail with out of memory.'));
          }
        }
        if (lease?.session) {
          lines.push(lease.session);
        }
        lines.push(trans.__('Run %gpu for details.'));
        return lines.join('\n');
      }
      case 'waiting': {
        const place =
          typeof k.eta_seconds === 'number'
            ? trans.__(
                'This kernel waits for a GPU: the number is its place in the queue; the broker estimates %1 from how long leases are held.',
                aboutWait(k.eta_seconds, trans)
              )
            : trans.__('This kernel waits for a GPU: the number is its place in the queue.');
        // the broker's why (a class session's reserved share names its course and end)
        return k.reason ? k.reason + '\n' + place : place;
      }
      case 'parking':
      case 'parked':
      case 'resuming':
        return this._parkedTitle(k);
      default:
        return k.reason ?? '';
    }
  }

  private _parkedTitle(k: IKernelLease): string {
    const trans = this._trans;
    const at = k.lease?.parked_at;
    const since =
      typeof at === 'number'
        ? ' ' + trans.__('(since %1)', new Date(at * 1000).toLocaleTimeString())
        : '';
    const lines = [
      trans.__(
        "This kernel's GPU memory was parked in the computer's memory while others waited%1.",
        since
      )
    ];
    if (k.state === 'resuming' && !k.position) {
      lines.push(trans.__('It is being restored now.'));
    } else if (k.position) {
      lines.push(
        typeof k.eta_seconds === 'number'
          ? trans.__(
              'Its resume waits in the GPU queue; the broker estimates %1.',
              aboutWait(k.eta_seconds, trans)
            )
          : trans.__('Its resume waits in the GPU queue.')
      );
    } else {
      lines.push(trans.__('Running a cell resumes it; your variables are kept.'));
    }
    lines.push(trans.__('Run %gpu for details.'));
    return lines.join('\n');
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
