//! `odfs-stored`: thin binary over the stored library.

fn main() {
    odfs_service::daemon_main::<odfs_stored::config::StoredConfig, _, _, _>(
        "odfs-stored",
        "odfs storage daemon",
        odfs_stored::service::run,
    );
}
