"""Parsing what Slurm 22.05 prints (lines captured from the one-node test cluster)."""

from __future__ import annotations

from pathlib import Path

from torchdoctor.slurm import client

SCONTROL = (
    "JobId=1 JobName=j.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
    "Nice=0 Account=(null) QOS=(null) JobState=COMPLETED Reason=None Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 "
    "TimeLimit=00:05:00 TimeMin=N/A SubmitTime=2026-12-01T10:01:00 NodeList=vm BatchHost=vm "
    "NumNodes=1 NumCPUs=2 NumTasks=1 CPUs/Task=2 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=2,mem=500M,node=1,billing=2 MinMemoryNode=500M Command=/tmp/slurmproto/j.sh "
    "WorkDir=/tmp/slurmproto StdOut=/tmp/slurmproto/j.sh-1.out Power= "
)
JOBCOMP = (
    "JobId=1 UserId=root(0) GroupId=root(0) Name=j.sh JobState=COMPLETED Partition=debug "
    "TimeLimit=5 StartTime=2026-12-01T10:01:02 EndTime=2026-12-01T10:01:09 NodeList=vm "
    "NodeCnt=1 ProcCnt=2 WorkDir=/tmp/slurmproto ReservationName= "
    "Tres=cpu=2,mem=500M,node=1,billing=2 Account= QOS= WcKey= Cluster=unknown "
    "SubmitTime=2026-12-01T10:01:00 EligibleTime=2026-12-01T10:01:00 DerivedExitCode=0:0 "
    "ExitCode=0:0 "
)


def test_scontrol_one_line_form() -> None:
    fields = client.parse_pairs(SCONTROL)
    assert fields["JobState"] == "COMPLETED" and fields["CPUs/Task"] == "2"
    assert fields["TRES"] == "cpu=2,mem=500M,node=1,billing=2"  # '=' inside a value
    assert fields["ReqB:S:C:T"] == "0:0:*:*" and fields["Power"] == ""
    assert fields["MinMemoryNode"] == "500M"


def test_jobcomp_filetxt_keeps_finished_jobs(tmp_path: Path) -> None:
    log = tmp_path / "jobcomp.log"
    log.write_text(JOBCOMP + "\n" + JOBCOMP.replace("JobId=1 ", "JobId=12 ") + "\n")
    conf = {"JobCompType": "jobcomp/filetxt", "JobCompLoc": str(log)}
    row = client.jobcomp_job("1", conf)
    assert row is not None and row["JobState"] == "COMPLETED" and row["NodeList"] == "vm"
    assert client.jobcomp_job("12", conf)["JobId"] == "12"
    assert client.jobcomp_job("2", conf) is None
    assert client.jobcomp_job("1", {"JobCompType": "jobcomp/none"}) is None
