"""Tier-2 tests against a real local Kubernetes cluster (``make e2e``); the cluster itself and
the tools that build what it runs are the ``e2e.harness`` package."""
