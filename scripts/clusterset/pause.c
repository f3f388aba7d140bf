/* The clusterset's pod sandbox ("pause") process: holds the pod's namespaces, reaps nothing,
 * exits on TERM or INT. Built static by scripts/clusterset.sh (no registry here). */
#include <signal.h>
#include <unistd.h>

static void bye(int sig) { (void)sig; _exit(0); }

int main(void) {
    signal(SIGTERM, bye);
    signal(SIGINT, bye);
    for (;;) pause();
}
