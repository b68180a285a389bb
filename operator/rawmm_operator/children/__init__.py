"""One builder module per kind of an RLRun's children (pure: RLRun in, manifests out).

They build on `rawmm_operator.pods` and `rawmm_operator.objects`; which child exists when, and how the
reconciler treats it, is declared once in `rawmm_operator.catalogue`.
"""
