"""What a job leaves and how it is read.

`results`: where a job's results live (`Place`) and how they are read back; `search`: a closed
job's or a pipeline's vectors searched; `vector_index` and `index_cache`: the index built from
the shards and the ones kept in memory; `thumbnails`: an input's or a frame's thumbnail;
`pipelines` and `pipeline_results`: a pipeline's state and its current results.
"""
