"""An E2B-compatible endpoint on ``fanfold serve``: the unmodified ``e2b`` SDK works against fanfold
with ``E2B_API_URL=<server>/e2b``, ``E2B_SANDBOX_URL=<server>/e2b/envd`` and ``E2B_API_KEY=<token>``.

Written from E2B's public protocol (its REST API and envd's Connect services), not from its code.
"""
