"""Signal storms: SIGKILL at random instants (and the instant `completed` is logged), SIGTERM at random
instants, delivered as schedulers deliver it (``launches.Stop``), in turn: to the launcher alone
(the kubelet: it must pass it on), to every process of the launch twice, half a second apart
(Slurm's preemption), and to the launcher then SIGKILL to every process after a grace drawn
within the uninterrupted run's length (Kubernetes). Each must checkpoint and exit 75 (or be
SIGKILLed once its grace ended: the stop is then cut short, and the previous checkpoint
stands); every trial then recovers through the harness.
"""

from __future__ import annotations

import time

from trainjob.deploy.launches import KUBELET, PREEMPTED, grace_ended, kill_when, last_event

from .harness import AS_DEPLOYED, STEPS, Campaign, Section, label, spawn


def kill_storm(campaign: Campaign, trials: int, flags: list[str] = STEPS, kills_per_trial: int = 3) -> Section:
    section = Section(label("kill storm", flags), note="under torchrun" if campaign.torchrun(flags) else "")
    seconds = campaign.seconds_for(flags) if trials else 0.0  # none: no timing run (torch may be absent)
    for trial in range(trials):
        section.trials += 1
        pvc = campaign.pvc("kill")
        chase_at = 0 if trial % 2 == 0 else kills_per_trial
        for launch in range(kills_per_trial + 1):
            done = last_event(pvc) == "completed"
            proc = spawn("run", "--pvc", pvc, *flags, AS_DEPLOYED, torchrun=campaign.torchrun(flags))
            # A random instant; or, chasing, the instant `completed` is logged (if still to come).
            deadline = time.monotonic() + campaign.rng.uniform(0, seconds)
            ready = (lambda: not done and last_event(pvc) == "completed") if launch == chase_at \
                else (lambda: time.monotonic() >= deadline)
            if kill_when(proc, ready, torchrun=campaign.torchrun(flags)):
                section.injected += 1
                section.late += last_event(pvc) == "completed"
                continue
            stderr, code = proc.stderr.read(), proc.wait()
            if code not in ((0,) if done else (0, 75)):
                section.violation(trial, f"a launch exited {code}: {stderr.strip()[-300:]}")
        campaign.recover(section, trial, pvc, flags)
    return section


def sigterm_storm(campaign: Campaign, trials: int, flags: list[str] = STEPS) -> Section:
    section = Section(label("sigterm", flags), note="signal sent once the run has logged its start"
                      + (", under torchrun" if campaign.torchrun(flags) else ""))
    seconds = campaign.seconds_for(flags) if trials else 0.0
    graces_cut = 0
    for trial in range(trials):
        section.trials += 1
        pvc = campaign.pvc("term")
        how = (KUBELET, PREEMPTED, grace_ended(campaign.rng.uniform(0, seconds / 4)))[trial % 3]
        proc = spawn("run", "--pvc", pvc, *flags, torchrun=campaign.torchrun(flags))
        # Before the interpreter has installed trainjob's handler, SIGTERM's default action
        # ends the process with nothing written; the storm targets the run itself.
        while last_event(pvc) is None and proc.poll() is None:
            time.sleep(0.005)
        deadline = time.monotonic() + campaign.rng.uniform(0, seconds / 2)
        if kill_when(proc, lambda: time.monotonic() >= deadline, how):
            section.injected += 1
        code = proc.wait(timeout=60)
        event = last_event(pvc)
        if code == 75:
            log = (pvc / "log.jsonl").read_text().splitlines()
            if event != "killed" or "signal=SIGTERM" not in log[-1]:
                section.violation(trial, f"{how.name}: exit 75 but the log ends with {event}")
        elif how.kill_after is not None and code == -9:
            graces_cut += 1  # the grace ended before the stop was saved: the recovery resumes before it
        elif not (code == 0 and event == "completed"):  # 0 only if it had finished already
            section.violation(trial, f"{how.name}: SIGTERM ended the run with exit {code}, log at {event}")
        campaign.recover(section, trial, pvc, flags)
    section.note += f"; to the launcher, to all twice, with a grace in turn ({graces_cut} graces ended mid-stop)"
    return section
