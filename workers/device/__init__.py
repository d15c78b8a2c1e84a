"""The device path of image models: the device stages (decode → fit → forward → outputs, each
stage on its own thread and CUDA stream), the GPU's JPEG decoders, the torch ops that fit a
batch on the device. Where a GPU decodes, the engine-owning process decodes here; elsewhere the
prep processes do (workers/prep). The calibrated stand-in that runs the same path on a CPU for
benches and tests is an engine: `workers/engines/standin.py`."""
