"""raypipe's Kubernetes deployment: KubeRay manifests (kustomize), the image, and their checks.

Not part of the installed package. `python -m kuberay.validate` checks the rendered overlays
offline (docs/kuberay.md); tests/unit/test_kuberay*.py run the same checks.
"""
