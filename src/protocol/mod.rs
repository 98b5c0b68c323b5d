pub mod commands;
pub mod ids;
pub mod replies;
pub mod shallow;
pub mod topics;
