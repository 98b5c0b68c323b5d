pub mod commands;
pub mod replies;
pub mod shallow;
pub mod topics;
