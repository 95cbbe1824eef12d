"""Compatibility layers for code written against other libraries' APIs.

``import ringlet.compat.bagua`` installs Bagua's tensor API names
(``ensure_bagua_tensor``, ``bagua_getter_closure``, ...) on ``torch.Tensor``.
"""
