"""Integrations with other training frameworks, each an optional dependency.

Nothing here is imported by ``import zerotrain``: import the integration you use, for
example ``import zerotrain.integrations.lightning`` (needs ``pip install zerotrain[lightning]``).
"""
