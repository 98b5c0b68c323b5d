//! Everything before the event loop: state dir, signal thread, install script, token check,
//! MQTT client. Each step logs one line; a step that makes running pointless returns the exit
//! code instead of a node.

use std::path::Path;
use std::path::PathBuf;
use std::time::Instant;

use crossbeam_channel::{unbounded, Receiver};

use super::parts::SystemClock;
use super::session::{self, Session};
use super::Node;
use crate::backend::{self, Backend, TokenCheck};
use crate::config::credentials::Identity;
use crate::config::Settings;
use crate::error::StartupError;
use crate::ledger::Ledger;
use crate::mqtt::{Mqtt, MqttEvent};
use crate::outbox::Outbox;
use crate::protocol::topics::Topics;
use crate::signals::{self, Signal};
use crate::workers::Workers;
use crate::workload::reaper::Reaper;
use crate::workload::tail::Tailer;
use crate::workload::Layout;
use crate::{store, util};

/// D46.3: the workload user exists and the node may become it (else exit 2); the state dir is
/// then passed through by it (0711), never listed, its files all the node's own (0600). D65: a
/// pool of users, each its own, at least as many as the slots; the node's secrets in the state
/// dir readable by nobody else.
fn workload_user_ready(
    spec: &str,
    dir: &Path,
    slots: u32,
) -> Result<Vec<crate::workload::user::WorkloadUser>, StartupError> {
    use crate::workload::user;
    let config =
        |e: String| StartupError::Config(format!("{e} (cloud_node.workload_user in the manifest)"));
    let pool = user::lookup_pool(spec)
        .and_then(|pool| {
            pool.iter()
                .try_for_each(user::check_privilege)
                .map(|()| pool)
        })
        .map_err(|e| config(e.to_string()))?;
    let n = u32::try_from(pool.len()).unwrap_or(u32::MAX);
    if n >= 2 && n < slots {
        return Err(config(format!(
            "workload_user names a pool of {n} users, fewer than max_concurrent_workloads ({slots}): each running workload needs a user of its own; name at least {slots} users, or lower max_concurrent_workloads"
        )));
    }
    secrets_closed(dir)?;
    user::traversable(dir).map_err(|e| {
        StartupError::Runtime(format!(
            "cannot open {} to the workload user: {e}",
            dir.display()
        ))
    })?;
    match pool.as_slice() {
        [u] => {
            log::info!(
                "workloads run as {} (uid {}, gid {}, {} group(s)); the state dir is closed to them",
                u.name,
                u.uid,
                u.gid,
                u.groups.len()
            );
            if slots > 1 {
                log::warn!("{}", crate::workload::user::shared_uid_note(&u.name, u.uid, slots));
            }
        }
        _ => log::info!(
            "workloads run as a pool of {} users ({}), each running workload as one no other holds; the state dir is closed to them",
            pool.len(),
            pool.iter()
                .map(|u| format!("{} uid {}", u.name, u.uid))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
    Ok(pool)
}

/// D65: with a workload user the state dir is opened to others (0711): a file in it that holds
/// the node's token (`.env`, `credentials.json`) must not be readable by group or others (exit 2
/// naming the file and the `chmod` to run).
fn secrets_closed(dir: &Path) -> Result<(), StartupError> {
    use std::os::unix::fs::PermissionsExt;
    for name in [".env", "credentials.json"] {
        let path = dir.join(name);
        let Ok(md) = std::fs::metadata(&path) else {
            continue;
        };
        let mode = md.permissions().mode() & 0o7777;
        if mode & 0o044 != 0 {
            return Err(StartupError::Config(format!(
                "{} holds the node's token and is readable by group or others (mode {mode:04o}), and workload_user opens the state dir {} to other users: run `chmod 600 {}`",
                path.display(),
                dir.display(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// Runs the node until it shuts down; returns the exit code.
pub fn run(settings: Settings) -> i32 {
    match prepare(settings) {
        Ok((node, signals)) => node.run(signals),
        Err(e @ StartupError::Stopped(_)) => {
            log::info!("{e}");
            log::info!("cyberwave-cloud-node stopped (exit code 0)");
            crate::error::Failure::exit(&e).code()
        }
        Err(e) => {
            log::error!("{e}");
            crate::error::Failure::exit(&e).code()
        }
    }
}

/// Start-up as a sequence of steps, each logging its line; the first that makes running
/// pointless ends it with a [`StartupError`] (its exit code).
pub fn prepare(s: Settings) -> Result<(Node, Receiver<Signal>), StartupError> {
    let started = Instant::now();
    let dir = s.config_dir.value.clone();
    let users = claim_state_dir(&s)?;
    let (sig_tx, sig_rx) = unbounded();
    signals::spawn(sig_tx).map_err(runtime("cannot start the signal thread"))?;
    let token = api_token(&s)?;
    // 1. Install script (D60).
    let installed = match s.install.as_ref() {
        Some(script) => super::install::run(&s, &script.value, &users, &sig_rx)?,
        None => super::install::Installed::default(),
    };
    let startup_failure = installed.failure.clone();
    // 2. Token check (REST E1).
    check_token(&s, &token)?;
    // 3. MQTT client.
    let (mqtt, events, client_id) = mqtt_client(&s)?;
    let identity = standalone_identity(&s);
    let topics = Topics::new(&s.topic_prefix.value, &client_id);
    let layout = Layout { state: dir.clone() };
    let exe = std::env::current_exe()
        // After an in-place upgrade /proc/self/exe names the deleted inode; the new binary
        // sits at the same path.
        .map(|p| PathBuf::from(p.to_string_lossy().trim_end_matches(" (deleted)")))
        .map_err(runtime(
            "cannot find this program's path (needed to supervise workloads)",
        ))?;
    let outbox = Outbox::load(dir.join("outbox")).map_err(runtime(format!(
        "cannot open the outbox in {}",
        dir.join("outbox").display()
    )))?;
    let (chunk_tx, chunks) = unbounded();
    let streams = super::streams::Streams::new(&super::logs::settings(&s));
    let tailer = Tailer::start(chunk_tx).map_err(runtime("cannot start the tailer thread"))?;
    let (done_tx, worker_done) = unbounded();
    let backend = Backend::of(&s, &token);
    let uploaders =
        crate::workers::uploaders(s.env.value("CYBERWAVE_NODE_UPLOAD_WORKERS").as_deref());
    let workers = Workers::start(backend, done_tx, uploaders)
        .map_err(runtime("cannot start the HTTP worker threads"))?;
    let ingress =
        crate::ingress_queue::EventQueue::load(dir.join("ingress"), s.tuning.ingress_queue_bytes)
            .map_err(runtime(format!(
            "cannot open the ingress queue in {}",
            dir.join("ingress").display()
        )))?;
    let (acks_tx, acked) = super::io::start_ack_thread()
        .map_err(runtime("cannot start the acknowledgement thread"))?;
    let control = control_socket(&dir, &users)?;
    let (gpu, monitor, gpu_rx) = gpus(&s);
    let container = super::container::detect(&s.env);
    let (spawner, spawned, (reaper, reaped)) = spawner(&s, &layout, exe, container.as_ref())?;
    let upload_cfg = super::table::UploadCfg {
        // D65: with a workload user a result must be its uid's own (the first user's for a
        // record that names none).
        checked: (!users.is_empty()).then(|| users.first().map(|u| u.uid)),
        ..super::table::UploadCfg::of(&s)
    };
    let now = Instant::now();
    let session = Session::new(
        session::Config::from_settings(&s, topics.clone(), token.clone()),
        identity,
        startup_failure,
        now,
    );
    let io = super::io::Io {
        clock: Box::new(SystemClock),
        layout,
        mqtt,
        events,
        topics,
        token,
        reaper,
        reaped,
        tailer,
        chunks,
        workers,
        worker_done,
        acks_tx,
        acked,
        control,
        gpu_rx,
        gpu_monitor: monitor,
        sweeper: crate::store::Sweeper::start(),
        users,
    };
    let mut node = Node {
        io,
        session,
        life: super::parts::Life {
            started,
            shutdown: None,
            exit: None,
            drain: super::parts::Drain::default(),
            metrics: Default::default(),
            container,
        },
        active: super::table::Table::new(upload_cfg),
        durable: super::parts::Durable {
            ledger: Ledger::load(dir.join("ledger.jsonl")),
            outbox,
        },
        starts: super::starts::Starts::new(spawner, spawned),
        streams,
        heal: Default::default(),
        ingress: super::events::Ingress::new(
            ingress,
            s.manifest.as_ref().and_then(|m| m.workflow_reporting) != Some(false),
            s.topic_prefix.value.clone(),
        ),
        gpu,
        services: super::service_watch::Services::load(&dir, now),
        timers: super::parts::Timers {
            due: super::parts::Due {
                watchdog: now,
                rescan: now,
                metrics: now,
                prune: now,
            },
            throttle: super::parts::Throttles::default(),
        },
        s,
    };
    node.services.adopt(
        installed.services,
        &super::service_watch::Origin::install(),
        None,
        &installed.children,
        now,
    );
    node.recover();
    // Re-adopted workloads holding GPUs are sampled at once.
    node.work().update_sampling();
    if !node.durable.outbox.is_empty() {
        log::info!(
            "{} message(s) in the outbox will be sent once connected",
            node.durable.outbox.len()
        );
    }
    Ok((node, sig_rx))
}

/// A host failure of a start-up step (exit 1): `what` and the error.
fn runtime<E: std::fmt::Display>(what: impl Into<String>) -> impl FnOnce(E) -> StartupError {
    let what = what.into();
    move |e| StartupError::Runtime(format!("{what}: {e}"))
}

/// D30: the state dir is ours and private, and no other node runs on it; checked before
/// anything is written there. The lock lives as long as the process (the node is never
/// dropped). Then the workload user, if the manifest names one (D46.3).
fn claim_state_dir(s: &Settings) -> Result<Vec<crate::workload::user::WorkloadUser>, StartupError> {
    let dir = &s.config_dir.value;
    let lock = crate::statedir::check_or_create(dir)
        .and_then(|()| crate::statedir::lock_waiting(dir, s.tuning.lock_wait))?;
    std::mem::forget(lock);
    log::info!(
        "cyberwave-cloud-node {} starting: state dir {} ({}), manifest {}",
        crate::cli::VERSION,
        dir.display(),
        s.config_dir.source,
        s.manifest
            .as_ref()
            .map(|m| m.path.display().to_string())
            .unwrap_or_else(|| "(none: environment only)".into())
    );
    let users = match s.manifest.as_ref().and_then(|m| m.workload_user.as_deref()) {
        Some(spec) => workload_user_ready(spec, dir, s.max_concurrent_workloads.value)?,
        None => Vec::new(),
    };
    if let Some(d) = crate::store::slow_disk_delay() {
        log::warn!(
            "simulated slow disk: every sync of the state waits {} ms first (CYBERWAVE_TEST_SLOW_FSYNC_MS, a test setting)",
            d.as_millis()
        );
    }
    Ok(users)
}

/// The API token (none needed standalone).
fn api_token(s: &Settings) -> Result<String, StartupError> {
    match (&s.api_token, s.standalone) {
        (Some(t), _) => Ok(t.value.clone()),
        (None, true) => Ok(String::new()),
        (None, false) => Err(StartupError::Config(format!(
            "no API token: set CYBERWAVE_API_KEY (environment, {}, or {}) or log in with `cyberwave login` ({})",
            s.working_dir.join(".env").display(),
            s.config_dir.value.join(".env").display(),
            s.config_dir.value.join("credentials.json").display()
        ))),
    }
}

/// The token check (REST E1): a rejected token ends start-up (exit 3); an inconclusive check
/// does not.
fn check_token(s: &Settings, token: &str) -> Result<(), StartupError> {
    if s.standalone {
        return Ok(());
    }
    let src = s
        .api_token
        .as_ref()
        .map(|t| t.source.to_string())
        .unwrap_or_default();
    match backend::check_token(&Backend::of(s, token), s.tuning.token_check_timeout) {
        TokenCheck::Accepted => log::info!(
            "API token {} accepted by {}",
            util::mask_secret(token),
            s.base_url.value
        ),
        TokenCheck::Rejected(status) => {
            return Err(StartupError::Credentials(format!(
                "the backend rejected the API token {} (HTTP {status}); it came from {src}. Fix or replace it there (e.g. `cyberwave login`).",
                util::mask_secret(token)
            )));
        }
        TokenCheck::Inconclusive(why) => {
            log::warn!("could not validate the API token at start-up ({why}); continuing")
        }
    }
    Ok(())
}

/// The MQTT client (not connected yet), its events and its client id.
fn mqtt_client(s: &Settings) -> Result<(Mqtt, Receiver<MqttEvent>, String), StartupError> {
    let client_id = client_id(&s.node_id_path()).map_err(runtime(format!(
        "cannot read or create {}",
        s.node_id_path().display()
    )))?;
    let opts = crate::config::broker::mqtt_options(s, client_id.clone(), s.tuning.session_expiry)
        .map_err(|e| StartupError::Config(e.to_string()))?;
    let (tx, rx) = unbounded();
    let mqtt = Mqtt::new(opts, tx).map_err(|e| StartupError::Runtime(e.to_string()))?;
    log::info!("MQTT client {client_id} → {}", mqtt.endpoint());
    if s.standalone {
        // No backend acknowledges a standalone node's workload statuses, so nothing else would
        // send one again that a lost connection took with it.
        mqtt.resend_requests();
    }
    Ok((mqtt, rx, client_id))
}

/// Identity: a standalone node names itself; otherwise the backend does, at registration.
fn standalone_identity(s: &Settings) -> Option<Identity> {
    if !s.standalone {
        return None;
    }
    let existing = s.identity.clone().filter(|i| i.standalone);
    Some(existing.unwrap_or_else(|| {
        let uuid = util::uuid_v4();
        let slug = s
            .slug_hint
            .as_ref()
            .map(|h| h.value.clone())
            .unwrap_or_else(|| format!("cn-{}", uuid.get(..8).unwrap_or(&uuid)));
        Identity {
            uuid,
            slug,
            workspace_slug: None,
            registered_at: Some(util::rfc3339(std::time::SystemTime::now())),
            standalone: true,
        }
    }))
}

/// The control socket (`emit`, `drain`, `status` from the CLI and the workloads).
fn control_socket(
    dir: &Path,
    users: &[crate::workload::user::WorkloadUser],
) -> Result<Receiver<crate::control::Request>, StartupError> {
    let (control_tx, control) = unbounded();
    // A directory in the socket's place cannot be replaced (a stale socket or file can): the
    // operator must remove it, and restarting would not help (exit 2, not a restart loop).
    let sock = dir.join("control.sock");
    if std::fs::symlink_metadata(&sock).is_ok_and(|m| m.is_dir()) {
        return Err(StartupError::Config(format!(
            "{} is a directory where the node's control socket belongs; remove that directory and start the node again",
            sock.display()
        )));
    }
    crate::control::serve(&sock, control_tx).map_err(runtime(format!(
        "cannot open the control socket {}",
        sock.display()
    )))?;
    if !users.is_empty() {
        // Workflow events from workloads still reach the node (D46.3 keeps `emit` working):
        // the socket is opened to a group every workload user is in; a pool without one
        // (D65) gets it opened to all, which still lets only `emit` through, and only with a
        // running workload's event token.
        let common = users.first().and_then(|first| {
            std::iter::once(first.gid)
                .chain(first.groups.iter().copied())
                .find(|g| users.iter().all(|u| u.gid == *g || u.groups.contains(g)))
        });
        let shared = match common {
            Some(gid) => crate::control::share_for_emit(&sock, gid),
            None => {
                std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            }
        };
        if let Err(e) = shared {
            log::warn!(
                "cannot open the control socket to the workload users: {e}; their workloads cannot report workflow events"
            );
        }
    }
    Ok(control)
}

/// The GPU part from the monitor thread's first inventory (D35), awaited here before any
/// command; each of its queries is killed at its timeout, so this wait is bounded.
fn gpus(
    s: &Settings,
) -> (
    super::gpus::Gpus,
    Option<crate::gpu::Monitor>,
    Receiver<crate::gpu::Snapshot>,
) {
    // Learned once at start-up: GPU count and VRAM tier.
    let telemetry = if s.hardware_telemetry {
        super::operate::gpu_inventory()
    } else {
        (0, None)
    };
    let timing = crate::gpu::Timing::from_env(&s.env);
    let (monitor, gpu_rx, first) = match crate::gpu::start(timing) {
        Ok((m, rx)) => {
            let wait = timing
                .timeout
                .saturating_mul(3)
                .saturating_add(std::time::Duration::from_secs(1));
            let first = rx.recv_timeout(wait).ok();
            (Some(m), rx, first)
        }
        Err(e) => {
            log::error!("cannot start the GPU monitor thread: {e}; no GPU is scheduled");
            (None, crossbeam_channel::never(), None)
        }
    };
    let per_workload = s.manifest.as_ref().and_then(|m| m.gpus_per_workload);
    let mut gpu = super::gpus::Gpus::new(first, &s.env, per_workload);
    gpu.telemetry = telemetry;
    (gpu, monitor, gpu_rx)
}

type SpawnerParts = (
    Result<crate::workload::spawner::Spawner, String>,
    Receiver<crate::workload::spawner::Outcome>,
    (Reaper, Receiver<crate::workload::reaper::Reaped>),
);

/// The reaper, then the spawner thread starts run on: without the spawner the node
/// still runs, reports and cancels its workloads, and refuses starts with a clear error.
fn spawner(
    s: &Settings,
    layout: &Layout,
    exe: PathBuf,
    container: Option<&super::container::Mode>,
) -> Result<SpawnerParts, StartupError> {
    let (reaped_tx, reaped) = unbounded();
    match container {
        Some(mode) => log::info!(
            "the node is its container's main process ({}): {}its workloads cannot outlive it here; on SIGTERM it stops them (a second SIGTERM: SIGKILL at once) and reports each one within {:.0}s (CYBERWAVE_NODE_STOP_GRACE_SECONDS)",
            mode.describe(),
            if mode.reaps_orphans() { "it reaps orphans, and " } else { "" },
            super::container::stop_grace(&s.env).as_secs_f64()
        ),
        None => {
            if let Some(pid1) = super::container::unknown_front(&s.env) {
                log::info!(
                    "the node runs in a PID namespace of its own, as the child of its PID 1 {pid1:?}, which is not an init it knows: if the container ends when the node does, set CYBERWAVE_NODE_INIT=1 so that it stops and reports its workloads first"
                );
            }
        }
    }
    let reaps = container.is_some_and(super::container::Mode::reaps_orphans);
    let reaper =
        Reaper::start(reaped_tx, reaps).map_err(runtime("cannot start the reaper thread"))?;
    let (spawned_tx, spawned) = unbounded();
    let spawner = crate::workload::spawner::Spawner::start(
        crate::workload::spawner::Context {
            settings: s.clone(),
            layout: layout.clone(),
            exe,
            ledger: layout.state.join("ledger.jsonl"),
            body: super::workloads::start_output,
        },
        spawned_tx,
    )
    .map_err(|e| {
        log::error!("cannot start the workload spawner thread: {e}; starts are refused");
        format!("cannot start the workload spawner thread: {e}")
    });
    Ok((spawner, spawned, (reaper, reaped)))
}

/// The MQTT client id, generated once and kept (decision D15) so restarts resume the session.
fn client_id(path: &Path) -> std::io::Result<String> {
    if let Some(id) = crate::config::credentials::load_node_id(path) {
        return Ok(id);
    }
    let id = format!("cloud_node_{}", util::hex(&util::random_bytes::<4>()));
    store::write_atomic(path, id.as_bytes(), 0o600)?;
    Ok(id)
}
