/* The pod sandbox's pause process: holds the pod's namespaces, reaps zombies (it is PID 1 of
 * the pod when the PID namespace is shared), exits 0 on SIGINT/SIGTERM. Build: cc -static -O2 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction q = {.sa_handler = quit}, r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
  sigaction(SIGINT, &q, 0); sigaction(SIGTERM, &q, 0); sigaction(SIGCHLD, &r, 0);
  for (;;) pause();
}
