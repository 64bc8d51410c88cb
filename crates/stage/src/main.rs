//! `odfs-agent`: thin binary over the stage agent.

fn main() {
    odfs_service::daemon_main::<odfs_stage::AgentConfig, _, _, _>(
        "odfs-agent",
        "odfs stage agent",
        odfs_stage::agent::run,
    );
}
