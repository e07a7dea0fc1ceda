// jupyter-gpu-lease in JupyterLab: the current kernel's GPU lease or queue place in the
// status bar, notifications while waiting ("Stop waiting") and when a lease ends, cells
// run while the kernel waits that are not lost (also over a reload), a notebook that keeps
// its waiting kernel over a reload, and a notebook saved with a GPU kernel that opens
// without taking a GPU until the student starts it. Data: the server extension
// provisioner.lab.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';

import { DeferredCells } from './deferred';
import { GPULeaseModel } from './model';
import { GPULeaseNotifier } from './notifications';
import { NotebookGuard } from './sessions';
import { GPULeaseStatus } from './statusbar';

const PLUGIN_ID = 'jupyter-gpu-lease:plugin';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'GPU lease status: the lease or queue place of the current kernel, and notifications.',
  autoStart: true,
  requires: [INotebookTracker, ISettingRegistry],
  optional: [IStatusBar, ITranslator],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    settings: ISettingRegistry,
    statusBar: IStatusBar | null,
    translator: ITranslator | null
  ) => {
    const trans = (translator ?? nullTranslator).load('jupyter_gpu_lease');
    const model = new GPULeaseModel();
    const deferred = new DeferredCells(
      tracker,
      trans,
      path => model.waitingFor(path)?.kernel_id ?? null
    );
    // the settings, once loaded (a notebook restored at start waits for them)
    const loaded = settings.load(PLUGIN_ID);
    const startOnOpen = async () => (await loaded).get('startGpuKernelsOnOpen').composite === true;
    new NotebookGuard(model, tracker, deferred, trans, startOnOpen);
    new GPULeaseNotifier(model, tracker, trans);
    if (statusBar) {
      const item = new GPULeaseStatus(model, tracker, trans);
      statusBar.registerStatusItem(PLUGIN_ID, {
        item,
        align: 'left',
        rank: 4
      });
    }
    // a kernel start or stop changes what to show: ask at once, not at the next tick
    tracker.widgetAdded.connect((_, panel) => {
      panel.sessionContext.statusChanged.connect(() => model.refreshSoon());
    });
    // the refresh interval's default lives in the schema (schema/plugin.json) only
    void loaded.then(s => {
      const apply = () => {
        const seconds = s.get('refreshInterval').composite as number;
        model.interval = Math.max(500, seconds * 1000);
      };
      apply();
      s.changed.connect(apply);
      model.start();
    });
  }
};

export default plugin;
