// The server extension's REST API (provisioner/lab/handlers.py), as the browser calls it.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** The broker's lease object (the Lease schema of provisioner/broker/openapi.py); only what we show is typed. */
export interface ILease {
  id: string;
  fraction: number;
  gpu: { uuid: string; node?: string; name?: string; memory_mb?: number };
  memory_limit_mb?: number;
  state: string;
  expires_at?: number;
  reason?: string | null;
}

/** One GPU kernel of this server: `GET {base_url}gpu-lease/api/kernels`. */
export interface IKernelLease {
  kernel_id: string;
  state: 'waiting' | 'active' | 'revoked' | 'expired' | 'released';
  fraction: number;
  lease?: ILease;
  position?: number;
  waiting?: number;
  eta_seconds?: number;
  reason?: string;
  /** the notebook's path (contents API), when the server knows it */
  path?: string;
  kernel_name?: string;
  waiting_since?: number;
  ended_at?: number;
}

const NAMESPACE = 'gpu-lease';

async function request(
  endpoint: string,
  init: RequestInit = {}
): Promise<Response> {
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
