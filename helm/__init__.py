"""The Helm chart (helm/kvtide) and the generator of its values schema.

A package only so `python -m helm.generate_schema` and the tests can import the generator.
"""
