// jupyter-gpu-lease in JupyterLab: the current kernel's GPU lease or queue place in the
// status bar, notifications while waiting ("Stop waiting") and when a lease ends, and cells
// run while the kernel waits that are not lost. Data: the server extension provisioner.lab.
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';

import { DeferredCells } from './deferred';
import { GPULeaseModel } from './model';
import { GPULeaseNotifier } from './notifications';
import { GPULeaseStatus } from './statusbar';

const PLUGIN_ID = 'jupyter-gpu-lease:plugin';
const DEFAULT_INTERVAL_MS = 2000;

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'GPU lease status: the lease or queue place of the current kernel, and notifications.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ISettingRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    statusBar: IStatusBar | null,
    settings: ISettingRegistry | null
  ) => {
    const model = new GPULeaseModel(DEFAULT_INTERVAL_MS);
    new DeferredCells(tracker);
    new GPULeaseNotifier(model, tracker);
    if (statusBar) {
      const item = new GPULeaseStatus(model, tracker);
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
    if (settings) {
      void settings.load(PLUGIN_ID).then(s => {
        const apply = () => {
          const seconds = s.get('refreshInterval').composite as number;
          model.interval = Math.max(500, seconds * 1000);
        };
        apply();
        s.changed.connect(apply);
      });
    }
  }
};

export default plugin;
