"""The models a job can name.

`catalog`: the built-ins and the registered ONNX models, versioned per tenant; `model_spec`: how a
registered image model is fed, and the checks its file passes at registration; `fallback`: a
job's fallback model, checked against the catalog at submission (its option's shape is
`kiln.app.families.fallback`).
"""
