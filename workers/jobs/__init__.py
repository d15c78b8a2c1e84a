"""Per job, outside its chunks: the bulk listing and what `kiln beat` sends."""
