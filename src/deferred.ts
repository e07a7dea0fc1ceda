// Cells run while the notebook's kernel still waits for its GPU run once it has started,
// also after a reload of the page.
//
// Why they were lost: while JupyterLab's `POST /api/sessions` waits (jupyter_server answers
// only when the kernel has started, i.e. after the GPU lease is granted), the notebook's
// session context has no kernel yet but is not "No Kernel" either (a kernel name is
// pending), so the notebook's cell runner goes on to `CodeCell.execute`, which returns at
// once without a kernel, clearing the cell: the run is dropped without a word. Here each
// cell scheduled in that state is remembered, marked as waiting ([*] and a line under the
// cell), and executed, in order, as soon as the kernel is there; if the start fails
// (refused, stopped waiting), the line says plainly that it did not run.
//
// The line is the page's, not an output: an output is part of the notebook and was saved
// into the .ipynb (by autosave too), where it came back in later sessions. Which cells wait
// is kept in this tab's sessionStorage (by cell id), so a reload finds them again.
import { Cell, CodeCell } from '@jupyterlab/cells';
import { ISessionContext } from '@jupyterlab/apputils';
import { INotebookTracker, Notebook, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';
import { Panel, Widget } from '@lumino/widgets';

import { recall, remember } from './memory';

/** What a tab keeps for a notebook whose cells wait: the waiting kernel and the cells. */
interface IKept {
  kernel: string;
  cells: { id: string; index: number; source: string }[];
}

/** The class of a cell's output wrapper while it shows a line. */
const LINED = 'jp-GPULease-lined';

/** A line under a cell: "waits for a GPU" or "did not run". Not part of the notebook. */
class CellLine extends Widget {
  constructor(kind: 'waiting' | 'not-run', text: string) {
    super();
    this.addClass('jp-GPULease-cellLine');
    this.node.dataset.kind = kind;
    this.node.setAttribute('role', 'status');
    this.node.textContent = text;
  }
}

export class DeferredCells {
  /** `kernelFor(path)`: the id of the kernel that waits for the notebook at `path`, if known. */
  constructor(
    private _tracker: INotebookTracker,
    trans: TranslationBundle,
    private _kernelFor: (path: string) => string | null = () => null
  ) {
    this._texts = {
      waiting: trans.__('Waiting for a GPU: this cell runs as soon as the kernel has started.'),
      notRun: trans.__(
        'This cell did not run: its kernel did not start (see the message about the GPU ' +
          'queue). Start the kernel again, then run the cell.'
      )
    };
    NotebookActions.executionScheduled.connect(this._onScheduled, this);
    // A reload aborts the page's own `POST /api/sessions`, and JupyterLab then says its
    // kernel start failed: that is no reason to forget the cells the next page runs.
    window.addEventListener('pagehide', () => (this._leaving = true));
    window.addEventListener('pageshow', () => (this._leaving = false));
  }

  /** Whether cells of this notebook wait for its kernel. */
  has(panel: NotebookPanel): boolean {
    return (this._pending.get(panel) ?? []).length > 0;
  }

  /**
   * A page opened (or reloaded) on a notebook whose kernel `kernelId` waits, or has just
   * started: the cells this tab kept for that kernel wait again, and run when it is there.
   */
  restore(panel: NotebookPanel, kernelId: string, started = false): void {
    const kept = recall<IKept | null>('session', this._key(panel), null);
    if (!kept) {
      return;
    }
    // a started kernel runs only cells kept for that very kernel
    if (kept.kernel !== kernelId && (kept.kernel || started)) {
      remember('session', this._key(panel), null); // another kernel's: never run them here
      return;
    }
    const cells = panel.content.widgets;
    for (const { id, index, source } of kept.cells) {
      const found =
        cells.find(c => c.model.id === id) ??
        (cells[index]?.model.sharedModel.getSource() === source ? cells[index] : undefined);
      if (found && found.model.type === 'code') {
        this._keep(panel, found as CodeCell, kernelId);
      }
    }
    if (panel.sessionContext.session?.kernel) {
      this._onKernel(panel.sessionContext);
    }
  }

  private _onScheduled(_: unknown, args: { notebook: Notebook; cell: Cell }): void {
    const { notebook, cell } = args;
    this._unline(cell);
    if (cell.model.type !== 'code' || !cell.model.sharedModel.getSource().trim()) {
      return;
    }
    const panel = this._tracker.find(p => p.content === notebook);
    if (!panel) {
      return;
    }
    if (panel.sessionContext.session?.kernel) {
      return; // runs now
    }
    // CodeCell.execute is about to drop this run: keep it for when the kernel comes
    this._keep(panel, cell as CodeCell, this._kernelFor(panel.sessionContext.path) ?? '');
  }

  private _keep(panel: NotebookPanel, cell: CodeCell, kernelId: string): void {
    const queue = this._pending.get(panel) ?? [];
    if (!queue.includes(cell)) {
      queue.push(cell);
    }
    if (!this._pending.has(panel)) {
      this._pending.set(panel, queue);
      const context = panel.sessionContext;
      context.kernelChanged.connect(this._onKernel, this);
      context.statusChanged.connect(this._onKernel, this);
      panel.disposed.connect(() => this._pending.delete(panel));
    }
    this._save(panel, kernelId);
    // after the synchronous clear of CodeCell.execute
    setTimeout(() => this._mark(panel, cell), 0);
  }

  /** This tab remembers the kept cells (a reload finds them again). */
  private _save(panel: NotebookPanel, kernelId: string): void {
    const cells = (this._pending.get(panel) ?? []).filter(c => !c.isDisposed);
    if (!cells.length) {
      remember('session', this._key(panel), null);
      return;
    }
    const widgets = panel.content.widgets;
    const kept: IKept = {
      kernel: kernelId || recall<IKept | null>('session', this._key(panel), null)?.kernel || '',
      cells: cells.map(c => ({
        id: c.model.id,
        index: widgets.indexOf(c),
        source: c.model.sharedModel.getSource()
      }))
    };
    remember('session', this._key(panel), kept);
  }

  private _key(panel: NotebookPanel): string {
    return `kept:${panel.sessionContext.path}`;
  }

  private _mark(panel: NotebookPanel, cell: CodeCell): void {
    if (cell.isDisposed || !(this._pending.get(panel) ?? []).includes(cell)) {
      return; // it ran meanwhile, or did not
    }
    this._line(cell, 'waiting', this._texts.waiting);
    cell.model.executionState = 'running';
  }

  /** Show `text` under the cell (in place of a line shown before). */
  private _line(cell: CodeCell, kind: 'waiting' | 'not-run', text: string): void {
    this._unline(cell);
    const line = new CellLine(kind, text);
    this._lines.set(cell, line);
    void cell.ready.then(() => {
      const wrapper = cell.outputArea?.parent;
      if (line.isDisposed || cell.isDisposed || !(wrapper instanceof Panel)) {
        return;
      }
      wrapper.addClass(LINED); // the line takes a row of its own, under the outputs
      wrapper.addWidget(line);
      line.disposed.connect(() => {
        if (!wrapper.isDisposed && !wrapper.widgets.some(w => w instanceof CellLine)) {
          wrapper.removeClass(LINED);
        }
      });
    });
  }

  private _unline(cell: Cell): void {
    const line = this._lines.get(cell);
    if (line) {
      this._lines.delete(cell);
      line.dispose();
    }
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
      remember('session', this._key(panel), null); // from here on they run (once)
      void this._runAll(panel, cells);
      return;
    }
    if (!['initializing', 'starting'].includes(context.kernelDisplayStatus)) {
      this.notRun(panel);
    }
  }

  /** The notebook's kernel did not start: each kept cell says so, and is no longer kept. */
  notRun(panel: NotebookPanel): void {
    if (this._leaving) {
      return;
    }
    const cells = this._pending.get(panel) ?? [];
    this._pending.set(panel, []);
    remember('session', this._key(panel), null);
    for (const cell of cells) {
      if (cell.isDisposed) {
        continue;
      }
      this._line(cell, 'not-run', this._texts.notRun);
      cell.model.executionState = 'idle';
    }
  }

  private async _runAll(panel: NotebookPanel, cells: CodeCell[]): Promise<void> {
    cells.forEach(cell => this._unline(cell));
    for (const [i, cell] of cells.entries()) {
      if (cell.isDisposed || panel.isDisposed) {
        continue;
      }
      try {
        const reply = await CodeCell.execute(cell, panel.sessionContext, {
          deletedCells: panel.content.model?.deletedCells ?? []
        });
        if (reply && reply.content.status !== 'ok') {
          cells.slice(i + 1).forEach(c => (c.model.executionState = 'idle'));
          break; // an error stops the rest, as "Run All" does
        }
      } catch {
        cells.slice(i + 1).forEach(c => (c.model.executionState = 'idle'));
        break;
      }
    }
  }

  private _pending = new Map<NotebookPanel, CodeCell[]>();
  private _leaving = false;
  private _lines = new WeakMap<Cell, CellLine>();
  private _texts: { waiting: string; notRun: string };
}
