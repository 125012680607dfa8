"""The sbatch script of a heterogeneous job: one `#SBATCH` block per het component (separated by
`#SBATCH hetjob`), one `srun --het-group=K` step per group, and the supervisor that ends the whole
allocation when a step fails or the orchestrator finishes (see SUPERVISOR). Every value that goes into
the script is checked here, so it is safe whatever it is given (no control characters; `%` literal).
"""
from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

from rlctl.launchers.groups import JobGroup, components
from rlctl.recipes.errors import RecipeError

DEFAULT_PREEMPT_TIMEOUT_S = 240.0  # deployment.preempt_timeout_s's default
RUN_FINISHED_EXIT = 3  # `python -m rlctl.launchers.resume --requeued` on a run that has DONE: do not start


def script_value(value, key: str) -> str:
    """`value` as text for the batch script; a control character is refused (RecipeError naming `key`):
    a newline would end the `#SBATCH`/comment line and start a command of its own."""
    text = str(value)
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise RecipeError(f"{text!r} contains a control character; Slurm fields take one plain line", key)
    return text


def slurm_path(path) -> str:
    """A literal path where Slurm expands %-patterns (`--output`, `--error`): `%` becomes `%%`."""
    return str(path).replace("%", "%%")


def _flag(key: str, value, recipe_key: str | None = None) -> str:
    return f"#SBATCH --{key}={shlex.quote(script_value(value, recipe_key or key))}"


def python_no_cwd(python: str) -> str:
    """The (shell-quoted) interpreter, with `-P` where it has it: nothing importable from the current
    directory (the job also runs in the run dir, `#SBATCH --chdir`)."""
    return f"{python} -P" if sys.version_info >= (3, 11) else python


def component_block(group: JobGroup) -> list[str]:
    where = f"deployment.{group.name}"
    lines = [_flag("nodes", group.nodes), _flag("ntasks-per-node", group.ntasks_per_node),
             _flag("cpus-per-task", group.cpus_per_task), _flag("time", group.time_limit, f"{where}.time_limit")]
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(group, key)
        if value:
            lines.append(_flag(key, value, f"{where}.{key}"))
    if group.gpus_per_node:
        lines.append(_flag("gpus-per-node", group.gpus_per_node))
    if group.mem_gib:
        lines.append(_flag("mem", f"{group.mem_gib}G"))
    return lines


def srun_line(group: JobGroup, folder: Path, python: str, het: bool = True) -> str:
    out = shlex.quote(slurm_path(script_value(folder / group.name, "deployment.output_dir"))) + '/"${SLURM_JOB_ID}"_%t_log'
    # a job of one component (a pool: servers and their front) is a plain job: srun refuses --het-group
    args = ["srun", *([f"--het-group={group.het_index}"] if het else []), "--unbuffered", "--kill-on-bad-exit=1"]
    if group.shares_component:  # one task beside another group's step on its first node
        args += ["--nodes=1", "--ntasks=1", "--overlap"]
    else:
        args += [f"--nodes={group.nodes}", f"--ntasks-per-node={group.ntasks_per_node}"]
    cmd = f"{python_no_cwd(python)} -u -m submitit.core._submit {shlex.quote(str(folder / group.name))}"
    return f"{' '.join(args)} --output={out}.out --error={out}.err {cmd} &"


SUPERVISOR = r"""
log() { echo "[rlctl $(date +%H:%M:%S)] $*"; }
rc_final=0; deadline=0; stopping=0; preempting=0; requeueing=0; sleeper=""; term_cause=""; declare -A ended=()
term_running() {  # TERM the tasks of every step still running, without waiting. Through scancel: it
  # signals the tasks and leaves their steps running (the trainer checkpoints in the grace period); a TERM
  # to srun itself makes srun kill its step at once (SIGKILL a second later). srun only if scancel fails.
  local i
  timeout 20 scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null && return 0
  for i in "${!pids[@]}"; do [[ -z ${ended[$i]:-} ]] && kill -TERM "${pids[$i]}" 2>/dev/null; done
}
stop_running() {
  stopping=1
  local i
  term_running
  for _ in $(seq 15); do
    local alive=0
    for i in "${!pids[@]}"; do kill -0 "${pids[$i]}" 2>/dev/null && alive=1; done
    (( alive )) || return 0
    sleep 1
  done
  for i in "${!pids[@]}"; do kill -KILL "${pids[$i]}" 2>/dev/null; done
}
term_cause_now() {  # why Slurm sent TERM, from the job's record (slurmctld updates it before signalling):
  # requeue = Slurm requeues the job itself (a preemption with PreemptMode=REQUEUE, `scontrol requeue`:
  # its restart count went up); preempt = preempted, not requeued (PreemptMode=CANCEL: PreemptTime set,
  # accounting state PREEMPTED); node_fail = requeued after a node failure; stop = scancel (CANCELLED),
  # the time limit, anything else
  local info restarts preempt_time
  info="$(timeout 20 scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | head -n 1 | tr ' ' '\n')"
  restarts="$(sed -n 's/^Restarts=//p' <<<"$info")"
  preempt_time="$(sed -n 's/^PreemptTime=//p' <<<"$info")"
  if [[ $restarts =~ ^[0-9]+$ ]] && (( restarts > RESTARTS )); then
    # a node failure requeues too, but a rank is gone: no collective checkpoint (accounting may lag a bit)
    local _ acct  # the newest ended record (-D: the requeued job already has a PENDING one)
    for _ in 1 2 3; do
      acct="$(timeout 20 sacct -D -n -X -P -j "$SLURM_JOB_ID" -o State 2>/dev/null | grep -v -e PENDING -e RUNNING | tail -n 1)"
      [[ -n $acct ]] && break
      sleep 1
    done
    [[ $acct == *NODE_FAIL* ]] && echo node_fail || echo requeue
  elif [[ -n $preempt_time && $preempt_time != None ]]; then echo preempt
  elif timeout 20 sacct -n -X -P -j "$SLURM_JOB_ID" -o State 2>/dev/null | grep -q '^PREEMPTED'; then echo preempt
  else echo stop; fi
}
checkpoint_trainer() {  # PREEMPT: the trainer saves the current step and exits; killed after PREEMPT_TIMEOUT
  echo "{\"time\": $(date +%s), \"job\": \"${SLURM_JOB_ID}\", \"cause\": \"$1\"}" > "$RLCTL_RUN_DIR/.PREEMPT.tmp"
  mv -f "$RLCTL_RUN_DIR/.PREEMPT.tmp" "$RLCTL_RUN_DIR/PREEMPT"
  local i until=$((SECONDS + PREEMPT_TIMEOUT))
  for i in "${!pids[@]}"; do
    [[ ${names[$i]} == trainer ]] || continue
    log "waiting up to ${PREEMPT_TIMEOUT}s for the trainer to checkpoint the current step"
    while kill -0 "${pids[$i]}" 2>/dev/null; do
      if (( SECONDS >= until )); then
        log "the trainer did not stop within ${PREEMPT_TIMEOUT}s (deployment.preempt_timeout_s): killing it"
        kill -KILL "${pids[$i]}" 2>/dev/null
        break
      fi
      sleep 1
    done
  done
}
preempt() {  # $1: usr2 (--signal before the time limit, or send_user_signal), requeue or preempt (TERM)
  if (( preempting )); then return 0; fi
  preempting=1
  if [[ -e $RLCTL_RUN_DIR/DONE ]]; then  # a finished run is never requeued (nor rewound)
    log "preemption ($1) after the run finished (DONE): no checkpoint, no requeue"
    preempting=0
    [[ $1 == usr2 ]] && return 0
    stop_running; exit "$rc_final"
  fi
  if (( RESTARTS >= MAX_RESTARTS )); then
    log "preemption ($1), no automatic restart left (${RESTARTS}/${MAX_RESTARTS}, deployment.max_restarts):" \
        "checkpointing, then stopping; continue with \`rlctl resume\`"
    checkpoint_trainer "$1"; stop_running; exit 143
  fi
  log "preemption ($1): checkpoint, then requeue"
  checkpoint_trainer "$1"
  case "$1/$term_cause" in
    */stop) log "cancelled during the checkpoint: no requeue"; stop_running; exit 143 ;;
    requeue/*|*/requeue|*/node_fail) log "Slurm requeues job ${SLURM_JOB_ID} (restart $((RESTARTS + 1))/${MAX_RESTARTS})"
                         stop_running; exit 143 ;;
  esac
  log "requeueing job ${SLURM_JOB_ID} (restart $((RESTARTS + 1))/${MAX_RESTARTS})"
  requeueing=1
  scontrol requeue "$SLURM_JOB_ID" || { log "scontrol requeue failed"; stop_running; exit 1; }
  sleep 60 & sleeper=$!
  wait $sleeper  # Slurm ends this allocation now (TERM runs on_term)
}
on_term() {
  if (( requeueing )); then
    log "job signalled after the requeue: stopping every group"
    kill "$sleeper" 2>/dev/null; stop_running; exit 143
  fi
  term_cause="$(term_cause_now)"
  if (( preempting )); then  # TERM while the trainer checkpoints: finish it, decide afterwards
    log "job signalled (TERM: ${term_cause}) during the preemption checkpoint"
    return 0
  fi
  case $term_cause in
    requeue|preempt) log "job signalled (TERM): Slurm preempts it (${term_cause})"; preempt "$term_cause" ;;
    node_fail) log "job signalled (TERM): a node failed, Slurm requeues the job (no PREEMPT: a rank may be gone)"
               stop_running; exit 143 ;;
    *) log "job signalled (TERM, not a preemption: scancel or time limit): stopping every group"
       stop_running; exit 143 ;;
  esac
}
trap on_term TERM
trap 'log "job interrupted: stopping every group"; stop_running; exit 130' INT
trap 'preempt usr2' USR2
while :; do
  running=0
  for i in "${!pids[@]}"; do
    [[ -n ${ended[$i]:-} ]] && continue
    if kill -0 "${pids[$i]}" 2>/dev/null; then running=$((running + 1)); continue; fi
    wait "${pids[$i]}"; rc=$?; ended[$i]=$rc
    log "group ${names[$i]} step exited with code $rc"
    (( rc != 0 && rc_final == 0 && stopping == 0 )) && rc_final=$rc
    if (( deadline == 0 )) && { (( rc != 0 )) || [[ ${names[$i]} == orchestrator ]]; }; then
      deadline=$((SECONDS + GRACE))
      if (( rc != 0 )); then  # told at once, the others wind down (the trainer checkpoints)
        log "asking the other groups to stop (TERM); what is left in ${GRACE}s is terminated"
        term_running
      else  # the others exit on DONE
        log "stopping the other groups within ${GRACE}s"
      fi
    fi
  done
  (( running == 0 )) && break
  if (( deadline > 0 && SECONDS >= deadline )); then
    log "grace period over: terminating the remaining steps"
    stop_running
    break
  fi
  sleep 1
done
log "job ends with code $rc_final"
exit $rc_final
"""


REQUEUED = r"""
# Automatic requeue (preemption, timeout signal, node failure): the same script runs again with
# SLURM_RESTART_COUNT > 0 as the next attempt, resuming from the newest complete checkpoint.
RESTARTS=${SLURM_RESTART_COUNT:-0}
if (( RESTARTS > 0 )); then
  if (( RESTARTS > MAX_RESTARTS )); then
    echo "[rlctl] requeued ${RESTARTS} times, more than deployment.max_restarts=${MAX_RESTARTS}: not starting"
    exit 1
  fi
  export RLCTL_ATTEMPT=$(( RLCTL_ATTEMPT + RESTARTS ))
  RLCTL_RESUME_STEP="$(PYTHON -m rlctl.launchers.resume --run-dir "$RLCTL_RUN_DIR" --requeued "$RLCTL_ATTEMPT")"
  case $? in
    0) ;;
    FINISHED) echo "[rlctl] requeued after the run finished (DONE): nothing to resume"; exit 0 ;;
    *) exit 1 ;;
  esac
  export RLCTL_RESUME_STEP
  # `#SBATCH --output` names the first attempt's folder: this attempt's lines go to its own
  attempt_log="$RLCTL_RUN_DIR/logs/attempt_${RLCTL_ATTEMPT}/slurm-${SLURM_JOB_ID}.out"
  echo "[rlctl] restart ${RESTARTS}/${MAX_RESTARTS}: attempt ${RLCTL_ATTEMPT}, continued in ${attempt_log}"
  exec >>"$attempt_log" 2>&1
  echo "[rlctl] restart ${RESTARTS}/${MAX_RESTARTS}: attempt ${RLCTL_ATTEMPT}, resume step '${RLCTL_RESUME_STEP}'"
fi
"""


def render_het_script(groups: list[JobGroup], folder: Path, python: str, *, job_name: str,
                      batch_log: Path, grace_period_s: int, env: dict[str, str] | None = None,
                      requeue: dict | None = None) -> str:
    """The complete sbatch script of a het job running `groups`. `requeue` = {"max_restarts",
    "signal_s", "timeout_s"}: USR2 that long before the time limit (or Slurm's SIGTERM of a preemption)
    makes the trainer checkpoint within `timeout_s` and the job requeue."""
    requeue = requeue or {"max_restarts": 0, "signal_s": 0}
    env = {key: script_value(value, f"env {key}") for key, value in (env or {}).items()}
    for key in env:
        if not (key.isidentifier() and key.isascii()):
            raise RecipeError(f"{key!r} is not a shell variable name", "env")
    job_name = script_value(job_name, "name")
    # The file name of `batch_log` is a Slurm pattern (slurm-%j.out); its directory is literal.
    batch_log = slurm_path(script_value(Path(batch_log).parent, "deployment.output_dir")) + "/" + Path(batch_log).name
    lines = ["#!/bin/bash", f"# rlctl heterogeneous job {job_name}: generated by `rlctl launch`, do not edit.",
             _flag("job-name", job_name, "name"), _flag("output", batch_log, "deployment.output_dir"),
             "#SBATCH --open-mode=append"]
    if env.get("RLCTL_RUN_DIR"):  # the job's current directory: the run dir, the owner's only
        lines.append(_flag("chdir", env["RLCTL_RUN_DIR"], "deployment.output_dir"))
    if requeue["max_restarts"] > 0:
        lines += ["#SBATCH --requeue"]
        if requeue["signal_s"] > 0:
            lines += [f"#SBATCH --signal=B:USR2@{int(requeue['signal_s'])}"]
    for k, comp in enumerate(components(groups)):
        if k:
            lines.append("#SBATCH hetjob")
        owner = comp[0]
        lines.append(f"# het component {k}: {', '.join(g.name for g in comp)}")
        lines += component_block(owner)
    lines += ["", "set -u", "umask 077  # result pickles and logs: owner only", "export SUBMITIT_EXECUTOR=slurm"]
    for key, value in env.items():
        lines.append(f"export {key}={shlex.quote(value)}")
    # Node addresses per component, looked up once here instead of by every task (names need not resolve).
    count = len(components(groups))
    het = count > 1
    for k in range(count):
        nodelist = f"${{SLURM_JOB_NODELIST_HET_GROUP_{k}:-$SLURM_JOB_NODELIST}}"  # unset in a plain job
        lines.append(f'RLCTL_NODE_ADDRS_{k}="$(scontrol show node -o "{nodelist}" | '
                     "tr ' ' '\\n' | awk -F= '$1==\"NodeName\"{n=$2} $1==\"NodeAddr\"{print n\"=\"$2}' | "
                     f'paste -sd, -)"; export RLCTL_NODE_ADDRS_{k}')
    lines += [f"MAX_RESTARTS={int(requeue['max_restarts'])}",
              f"PREEMPT_TIMEOUT={max(1, math.ceil(requeue.get('timeout_s', DEFAULT_PREEMPT_TIMEOUT_S)))}",
              REQUEUED.replace("PYTHON", python_no_cwd(python)).replace("FINISHED", str(RUN_FINISHED_EXIT)).strip()]
    lines += [f"GRACE={int(grace_period_s)}", "pids=(); names=()"]
    for group in groups:
        lines.append(srun_line(group, folder, python, het))
        lines.append(f"pids+=($!); names+=({group.name})")
    return "\n".join(lines) + "\n" + SUPERVISOR


def shlex_python() -> str:
    """The interpreter tasks run with (submitit's default: this one)."""
    return shlex.quote(sys.executable)


def strip_slurm_env(environ: dict[str, str]) -> list[str]:
    """Variables inherited from an enclosing Slurm job that would leak into the new job's options."""
    return sorted(k for k in environ if k.startswith("SLURM_") and k != "SLURM_CONF")
