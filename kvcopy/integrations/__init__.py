"""Adapters that make kvcopy the KV offload path of existing inference engines.

Each adapter is its own module and imports its engine only when used, so
``import kvcopy`` never needs an engine installed:

- :mod:`kvcopy.integrations.transformers`: Hugging Face transformers'
  continuous batching (``pip install 'kvcopy[transformers]'``).
"""

__all__: list[str] = []
