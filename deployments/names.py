"""Deployment names inside a kvtide application (handles look deployments up by name)."""

ENGINE_DEPLOYMENT = "Engine"
INGRESS_DEPLOYMENT = "Ingress"
