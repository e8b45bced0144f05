"""The Ray Jobs API (``JobSubmissionClient``) as a command, for tests/test_ray_jobs.py.

Run in its own process so the head's token (``RAY_AUTH_TOKEN_PATH``) never enters the test
process, whose own local Ray must not see it. Prints one JSON object on stdout.

    ray_jobs_client.py ADDRESS submit ID WORKING_DIR ENTRYPOINT
    ray_jobs_client.py ADDRESS wait ID TIMEOUT_S      -> {"status", "driver_exit_code", "logs"}
    ray_jobs_client.py ADDRESS wait-running ID TIMEOUT_S
    ray_jobs_client.py ADDRESS stop ID
"""

from __future__ import annotations

import json
import sys
import time

from ray.job_submission import JobStatus, JobSubmissionClient


def main() -> int:
    address, what, job_id, *rest = sys.argv[1:]
    client = JobSubmissionClient(address)
    if what == "submit":
        working_dir, entrypoint = rest
        client.submit_job(
            entrypoint=entrypoint,
            submission_id=job_id,
            runtime_env={"working_dir": working_dir},
        )
        print(json.dumps({"submitted": job_id}))
        return 0
    if what == "stop":
        print(json.dumps({"stopped": client.stop_job(job_id)}))
        return 0
    end = time.monotonic() + float(rest[0])
    while True:
        status = client.get_job_status(job_id)
        done = status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)
        if done or (what == "wait-running" and status == JobStatus.RUNNING):
            break
        if time.monotonic() > end:
            break
        time.sleep(0.5)
    info = client.get_job_info(job_id)
    print(
        json.dumps(
            {
                "status": str(status.value),
                "driver_exit_code": info.driver_exit_code,
                "message": info.message,
                "logs": client.get_job_logs(job_id),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
