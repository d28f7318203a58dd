"""LRP as modified VJPs: the rules, their composites, and the walks that hand relevance back.

``method`` is `tdhook_fn.attribution.lrp`; ``rules`` and ``composites`` the rules and
their mapping onto modules; ``module_call``, ``records`` and ``affine`` what a rule reads
of a module's call; ``chain``, ``plan``, ``walk`` and ``model_chain`` the module-by-module
walk of a chain of modules (DeepLift rides on the same walk); ``checks`` and ``fused``
the conservation checks and fused rules; ``max_pool`` the pooling both walks share.
"""
