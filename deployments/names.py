"""Deployment names inside a kvtide application (handles look deployments up by name)."""

ENGINE_DEPLOYMENT = "Engine"
INGRESS_DEPLOYMENT = "Ingress"  # ingress mode: the OpenAI front door in front of the engines
ROUTER_DEPLOYMENT = "Router"  # direct mode: the routing peer HAProxy consults
