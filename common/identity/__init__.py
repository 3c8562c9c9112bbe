"""What a stored object is and whose it is: chunk keys, tenants' names, object headers and
expectations, layout and model fingerprints, the weights an engine holds, head splits."""
