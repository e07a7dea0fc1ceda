// The server extension's REST API (provisioner/lab/handlers.py), as the browser calls it.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** The broker's lease object (the Lease schema of provisioner/broker/web/openapi.py); only what we show is typed. */
export interface ILease {
  id: string;
  fraction: number;
  gpu: { uuid: string; node?: string; name?: string; memory_mb?: number };
  memory_limit_mb?: number;
  /** GPU memory its kernel's processes used at the node agent's last report (MiB) */
  used_mb?: number | null;
  state: string;
  expires_at?: number;
  reason?: string | null;
  /** when the broker began parking its GPU memory (s since the epoch), else null */
  parked_at?: number | null;
  /** while a class session of the user's course is held: "GPU reserved for ml101 until 11:30" */
  session?: string | null;
}

/** A lease whose GPU memory the broker parked in host RAM (or is parking, or restoring). */
export const PARK_STATES = ['parking', 'parked', 'resuming'] as const;
export type ParkState = (typeof PARK_STATES)[number];

/** Whether `state` is one of the parked states (alive: running a cell resumes it). */
export function isParked(state: string | undefined): state is ParkState {
  return (PARK_STATES as readonly string[]).includes(state ?? '');
}

/** One GPU kernel of this server: `GET {base_url}gpu-lease/api/kernels`. */
export interface IKernelLease {
  kernel_id: string;
  state: 'waiting' | 'active' | ParkState | 'revoked' | 'expired' | 'released';
  fraction: number;
  lease?: ILease;
  /** waiting: the place in the GPU queue; parked/resuming: the resume's place while it waits */
  position?: number;
  waiting?: number;
  eta_seconds?: number;
  reason?: string;
  /** the notebook's path (contents API), when the server knows it */
  path?: string;
  kernel_name?: string;
  waiting_since?: number;
  /** parking/parked/resuming: when the server first saw it so (s since the epoch) */
  parked_since?: number;
  ended_at?: number;
}

const NAMESPACE = 'gpu-lease';

async function request(endpoint: string, init: RequestInit = {}): Promise<Response> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, NAMESPACE, 'api', endpoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  if (!response.ok) {
    let message = response.statusText;
    try {
      message = (await response.json()).message || message;
    } catch {
      // not JSON: keep the status text
    }
    throw new ServerConnection.ResponseError(response, message);
  }
  return response;
}

/** This server's GPU kernels: waiting, holding a lease, or recently ended. */
export async function fetchKernels(): Promise<IKernelLease[]> {
  const response = await request('kernels');
  const body = await response.json();
  return (body.kernels ?? []) as IKernelLease[];
}

/** Give up a waiting kernel's place in the GPU queue (its start then fails). */
export async function stopWaiting(kernelId: string): Promise<void> {
  await request(`kernels/${encodeURIComponent(kernelId)}/request`, {
    method: 'DELETE'
  });
}

/** The notebook's path, name and type of a session (as JupyterLab's session context has them). */
export interface ISessionWhere {
  path: string;
  name: string;
  type: string;
}

/**
 * Wait until the kernel that waits for its GPU has started, then make its session the
 * notebook's (`path`): a reloaded page re-attaches to its waiting kernel instead of
 * starting a second one. Rejects with the start's error when the kernel did not start.
 */
export async function attachSession(kernelId: string, where: ISessionWhere): Promise<void> {
  for (;;) {
    const response = await request(`kernels/${encodeURIComponent(kernelId)}/session`, {
      method: 'POST',
      body: JSON.stringify(where)
    });
    if (response.status !== 202) {
      return; // its session is the notebook's now
    }
  }
}

/** Why this user can never start kernelspec `name`, or null (unknown here, or startable). */
export async function whyNotKernel(
  name: string
): Promise<{ display_name: string; message: string } | null> {
  try {
    const response = await request(`kernelspecs/${encodeURIComponent(name)}`);
    const body = await response.json();
    return body.startable === false ? body : null;
  } catch {
    return null;
  }
}

/** What starting a GPU kernelspec would take now: `GET .../kernelspecs/{name}/outlook`. */
export interface IOutlook {
  name: string;
  display_name: string;
  fraction: number;
  /** the GPU model it would most likely get (the one with the most room), if known */
  gpu_name?: string | null;
  /** a GPU has room for it and nobody waits: it would start at once */
  free_now: boolean;
  /** else: the place it would take at the end of the GPU queue */
  position?: number | null;
  queue_length?: number | null;
  /** a class session held now: "GPU reserved for ml101 until 11:30" (to a member) */
  session?: string | null;
}

/** What starting kernelspec `name` would take now, or null when the server cannot say. */
export async function fetchOutlook(name: string): Promise<IOutlook | null> {
  try {
    const response = await request(`kernelspecs/${encodeURIComponent(name)}/outlook`);
    return (await response.json()) as IOutlook;
  } catch {
    return null;
  }
}

/** The provisioner of GPU kernels, as kernelspecs name it (pyproject's entry point). */
export const PROVISIONER = 'gpu-lease-provisioner';

/** The GPU fraction of a kernelspec (as the kernelspec API lists it), or null for a CPU one. */
export function gpuFraction(spec: { metadata?: unknown } | undefined | null): number | null {
  const metadata = (spec?.metadata ?? {}) as {
    kernel_provisioner?: { provisioner_name?: string; config?: { fraction?: unknown } };
  };
  const provisioner = metadata.kernel_provisioner;
  if (provisioner?.provisioner_name !== PROVISIONER) {
    return null;
  }
  const fraction = provisioner.config?.fraction;
  return typeof fraction === 'number' && fraction > 0 ? fraction : null;
}
