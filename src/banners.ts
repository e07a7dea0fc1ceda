// Banners above a notebook (in its panel's contentHeader): why its last GPU lease ended,
// and, for a notebook opened without starting its GPU kernel, what starting it would take.
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { fetchOutlook, IKernelLease } from './api';
import { outlookText } from './format';
import { RememberedIds } from './memory';

/** A banner whose height follows its wrapped text. */
class HeaderBanner extends Widget {
  constructor(className: string) {
    super();
    this.addClass('jp-GPULease-banner');
    this.addClass(className);
    this.hide();
  }

  protected onAfterShow(): void {
    this.fitHeight();
  }

  protected onResize(): void {
    this.fitHeight();
  }

  /** The notebook's header is a BoxPanel, which sizes a child by its CSS minimum only:
   * make that the wrapped content's height, whatever the width. */
  protected fitHeight(): void {
    requestAnimationFrame(() => {
      if (this.isHidden || this.isDisposed) {
        return;
      }
      const style = getComputedStyle(this.node);
      const content = Math.max(
        ...Array.from(this.node.children).map(c => c.getBoundingClientRect().height)
      );
      const needed = Math.ceil(
        content +
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
}

/** Why the notebook's last GPU lease ended, whole; closable, and closed it stays closed. */
export class EndedBanner extends HeaderBanner {
  constructor(trans: TranslationBundle) {
    super('jp-GPULease-ended');
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
      this.fitHeight();
    }
    this.show();
  }

  private _text: HTMLDivElement;
  private _kernelId = '';
  private _dismissed = new RememberedIds('dismissed');
}

/** How often a shown "not started" banner asks again what starting would take (ms). */
export const OUTLOOK_MS = 5000;

/**
 * A notebook saved with a GPU kernel, opened without starting it: which kernel, what it
 * would take now ("GPU 1 · 100 % of a V100 · free now" / "2nd in queue"), and Start.
 */
export class HeldBanner extends HeaderBanner {
  constructor(
    private _trans: TranslationBundle,
    private _kernel: { name: string; display: string; fraction: number },
    onStart: () => void
  ) {
    super('jp-GPULease-held');
    this.node.setAttribute('role', 'status');
    const body = document.createElement('div');
    body.className = 'jp-GPULease-held-text';
    const what = document.createElement('div');
    what.textContent = _trans.__(
      'The kernel "%1" was not started: it takes a GPU, which others may be waiting for. Start it when you need it.',
      _kernel.display
    );
    this._outlook = document.createElement('div');
    this._outlook.className = 'jp-GPULease-outlook';
    this._outlook.textContent = outlookText(_kernel.fraction, null, _trans);
    body.append(what, this._outlook);
    const start = document.createElement('button');
    start.className = 'jp-Button jp-mod-accept jp-mod-styled jp-GPULease-start';
    start.textContent = _trans.__('Start kernel');
    start.title = _trans.__(
      'Start "%1" (it joins the GPU queue if no GPU is free)',
      _kernel.display
    );
    start.addEventListener('click', () => {
      this.hide();
      onStart();
    });
    this.node.append(body, start);
  }

  protected onAfterShow(): void {
    super.onAfterShow();
    void this._ask();
    this._timer = window.setInterval(() => void this._ask(), OUTLOOK_MS);
  }

  protected onAfterHide(): void {
    window.clearInterval(this._timer);
  }

  dispose(): void {
    window.clearInterval(this._timer);
    super.dispose();
  }

  private async _ask(): Promise<void> {
    const outlook = await fetchOutlook(this._kernel.name);
    if (this.isDisposed) {
      return;
    }
    const text = outlookText(this._kernel.fraction, outlook, this._trans);
    if (this._outlook.textContent !== text) {
      this._outlook.textContent = text;
      this.fitHeight();
    }
  }

  private _outlook: HTMLDivElement;
  private _timer = 0;
}
