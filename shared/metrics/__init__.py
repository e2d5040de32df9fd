"""Measuring a model: pose metrics (``pose``: PCKh, OKS AP), the face tasks' metrics (``face``) and the
evaluation of a model on a list of records (``evaluation``).
"""
