//! `odfs-metad`: thin binary over the metad library.

fn main() {
    odfs_service::daemon_main::<odfs_metad::config::MetadConfig, _, _, _>(
        "odfs-metad",
        "odfs metadata daemon",
        odfs_metad::service::run,
    );
}
