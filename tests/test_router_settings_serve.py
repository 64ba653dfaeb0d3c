"""`args.router` of a Serve config file reaches the KV-aware router's policy (real Ray Serve, one
tiny-llama replica), and an explicit `request_router_config` under `deployments:` wins over it.

The file is serve_config.yaml with the tiny model and router settings, plus a second application
that overrides the router under `deployments:`; it is deployed as `serve run <file>` deploys one
(ray/serve/scripts.py: validated as a ServeDeploySchema, then deploy_apps). The router checked is
the one a DeploymentHandle to LLMServer builds in this process, from the deployment config the
controller sends every handle (the ingress's included).
"""

import copy

import yaml
from ray import serve

from app.router.policy import RoutingPolicy
from tests.serve_testing import REPO_ROOT, local_serve, wait_until

OVERRIDE = {"request_router_class": "app.router.kv_router:KVAwareRouter", "request_router_kwargs": {"load_factor": 3.0}}


def write_config(path) -> None:
    """serve_config.yaml with `args.router` set (application "llm"), and the same as application
    "override" whose `deployments:` sets LLMServer's request_router_config."""
    config = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    app["args"]["engine"].update(model="tiny-llama", kv_cache_memory="64MiB")  # routing, not the model
    app["args"]["model_id"] = "tiny-llama"
    app["args"]["router"] = {"load_factor": 1.75, "slack": 5, "min_match_blocks": 3}
    override = copy.deepcopy(app)
    override.update(name="override", route_prefix="/override",
                    deployments=[{"name": "LLMServer", "request_router_config": OVERRIDE}])
    config["applications"].append(override)
    path.write_text(yaml.safe_dump(config))


def deploy_file(path) -> None:
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    # local_serve started Serve on a free port: only the file's applications are deployed
    _get_global_client().deploy_apps(ServeDeploySchema(applications=config.applications), _blocking=False)


def running(*apps: str) -> bool:
    status = serve.status().applications
    return all(app in status and status[app].status == "RUNNING" for app in apps)


def handle_policy(app: str) -> RoutingPolicy:
    """The policy of the KV-aware router a new handle to the app's LLMServer builds."""
    handle = serve.get_deployment_handle("LLMServer", app_name=app)
    handle.model_info.remote().result(timeout_s=60)  # the handle's first call creates its router
    return handle._router._asyncio_router.request_router.policy  # Ray Serve 2.60's internals


def test_router_settings_of_the_config_file_reach_the_routers_policy(tmp_path):
    write_config(tmp_path / "serve_config.yaml")
    with local_serve(num_cpus=2):
        deploy_file(tmp_path / "serve_config.yaml")
        assert wait_until(lambda: running("llm", "override"), timeout_s=300, interval_s=1), serve.status()
        assert handle_policy("llm") == RoutingPolicy(load_factor=1.75, slack=5, min_match_blocks=3)
        # the explicit request_router_config replaces the one derived from args.router
        assert handle_policy("override") == RoutingPolicy(load_factor=3.0)
