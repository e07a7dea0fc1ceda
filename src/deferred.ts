// Cells run while the notebook's kernel still waits for its GPU run once it has started.
//
// Why they were lost: while JupyterLab's `POST /api/sessions` waits (jupyter_server answers
// only when the kernel has started, i.e. after the GPU lease is granted), the notebook's
// session context has no kernel yet but is not "No Kernel" either (a kernel name is
// pending), so the notebook's cell runner goes on to `CodeCell.execute`, which returns at
// once without a kernel, clearing the cell: the run is dropped without a word. Here each
// cell scheduled in that state is remembered, marked as waiting ([*] and a line of output),
// and executed, in order, as soon as the kernel is there; if the start fails (refused,
// stopped waiting), its output says plainly that it did not run.
import { Cell, CodeCell } from '@jupyterlab/cells';
import { ISessionContext } from '@jupyterlab/apputils';
import { INotebookTracker, Notebook, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';

import * as nbformat from '@jupyterlab/nbformat';
import { TranslationBundle } from '@jupyterlab/translation';

/** Replace a cell's outputs by ``output`` (unless that is what it shows already). */
function showOnly(cell: CodeCell, output: nbformat.IStream): void {
  const outputs = cell.model.outputs;
  const shown = outputs.toJSON();
  if (shown.length === 1 && shown[0].text === output.text && shown[0].name === output.name) {
    return;
  }
  outputs.clear();
  outputs.add(output);
}

export class DeferredCells {
  constructor(
    private _tracker: INotebookTracker,
    trans: TranslationBundle
  ) {
    this._texts = {
      waiting:
        trans.__('Waiting for a GPU: this cell runs as soon as the kernel has started.') + '\n',
      notRun:
        trans.__(
          'This cell did not run: its kernel did not start (see the message about the GPU ' +
            'queue). Start the kernel again, then run the cell.'
        ) + '\n'
    };
    NotebookActions.executionScheduled.connect(this._onScheduled, this);
  }

  /** Whether cells of this notebook wait for its kernel. */
  has(panel: NotebookPanel): boolean {
    return (this._pending.get(panel) ?? []).length > 0;
  }

  private _onScheduled(_: unknown, args: { notebook: Notebook; cell: Cell }): void {
    const { notebook, cell } = args;
    if (cell.model.type !== 'code' || !cell.model.sharedModel.getSource().trim()) {
      return;
    }
    const panel = this._tracker.find(p => p.content === notebook);
    if (!panel) {
      return;
    }
    const context = panel.sessionContext;
    if (context.session?.kernel) {
      return; // runs now
    }
    // CodeCell.execute is about to drop this run: keep it for when the kernel comes
    const queue = this._pending.get(panel) ?? [];
    if (!queue.includes(cell as CodeCell)) {
      queue.push(cell as CodeCell);
    }
    if (!this._pending.has(panel)) {
      this._pending.set(panel, queue);
      context.kernelChanged.connect(this._onKernel, this);
      context.statusChanged.connect(this._onKernel, this);
      panel.disposed.connect(() => this._pending.delete(panel));
    }
    // after the synchronous clear of CodeCell.execute
    setTimeout(() => this._mark(cell as CodeCell), 0);
  }

  private _mark(cell: CodeCell): void {
    if (cell.isDisposed) {
      return;
    }
    // Not inside sharedModel.transact: the output model mirrors itself into the shared
    // model with a 'silent-change' origin, which an enclosing transaction replaces, so the
    // change came back as a second copy (the waiting line shown twice, the "did not run"
    // line cleared at once).
    showOnly(cell, { output_type: 'stream', name: 'stdout', text: this._texts.waiting });
    cell.model.executionState = 'running';
  }

  private _onKernel(context: ISessionContext): void {
    const panel = this._tracker.find(p => p.sessionContext === context);
    if (!panel) {
      return;
    }
    const cells = this._pending.get(panel);
    if (!cells || !cells.length) {
      return;
    }
    if (context.session?.kernel) {
      this._pending.set(panel, []);
      void this._runAll(panel, cells);
      return;
    }
    if (!['initializing', 'starting'].includes(context.kernelDisplayStatus)) {
      this.notRun(panel);
    }
  }

  /** The notebook's kernel did not start: each kept cell says so, and is no longer kept. */
  notRun(panel: NotebookPanel): void {
    const cells = this._pending.get(panel) ?? [];
    this._pending.set(panel, []);
    for (const cell of cells) {
      if (cell.isDisposed) {
        continue;
      }
      showOnly(cell, { output_type: 'stream', name: 'stderr', text: this._texts.notRun });
      cell.model.executionState = 'idle';
    }
  }

  private async _runAll(panel: NotebookPanel, cells: CodeCell[]): Promise<void> {
    for (const cell of cells) {
      if (cell.isDisposed || panel.isDisposed) {
        continue;
      }
      try {
        const reply = await CodeCell.execute(cell, panel.sessionContext, {
          deletedCells: panel.content.model?.deletedCells ?? []
        });
        if (reply && reply.content.status !== 'ok') {
          break; // an error stops the rest, as "Run All" does
        }
      } catch {
        break;
      }
    }
  }

  private _pending = new Map<NotebookPanel, CodeCell[]>();
  private _texts: { waiting: string; notRun: string };
}
