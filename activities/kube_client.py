"""The Kubernetes API client FleetMedic's processes share: the worker's activities and providers,
and the node agent (which reads only its own Node). Small on purpose: the agent imports this, not
the activities."""

from __future__ import annotations

from kubernetes import client, config
from kubernetes.client import ApiClient


def load_api_client(kubeconfig: str | None) -> ApiClient:
    """In-cluster config when running in a pod, else KUBECONFIG / ~/.kube/config.

    urllib3's own retries are off: a timeout must surface after one `_request_timeout`, and
    Temporal's retry policy (bounded, visible in the history) does the retrying.
    """
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    configuration.retries = False
    return ApiClient(configuration)
