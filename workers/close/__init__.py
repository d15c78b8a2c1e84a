"""The job's close: what runs once a job's last chunk is in (groups, library, identical inputs)."""
