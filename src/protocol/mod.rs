pub mod commands;
pub mod replies;
pub mod topics;
