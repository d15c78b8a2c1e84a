"""What a job is and how it goes, the services the API, the console and the CLI share.

`jobs`: submit, cancel, progress; `job_counts`: what a job's counts mean together;
`job_lookup`: a job found by its id or a prefix; `ingest`: a bulk job over a listing;
`schedules`: a pipeline's nightly runs; `outputs`: the check of a job's output before it is
recorded; `throughput`: items/s from each chunk run's span.
"""
