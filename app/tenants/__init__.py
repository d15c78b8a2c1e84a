"""Who calls Kiln and what each caller may do.

`auth`: API keys, one tenant each; `tenants`: the buckets a tenant may name; `quotas`: its
request rate and its cap on open jobs.
"""
